"""Run inside a network namespace by test_two_hosts: the attention host of a two-host
deployment. Starts SGLang with ``--eaas`` on the expert servers registered at an etcd monitor on
the other host (slots over Mooncake's Transfer Engine), generates greedily for each prompt given
as a JSON list on stdin and prints ``tokens JSON`` (their output ids), then stops it.

    python netns_sglang_host.py MODEL ETCD_URL LOG_PATH NEW_TOKENS < prompts.json
"""

from __future__ import annotations

import json
import sys

from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer


def main() -> int:
    model, monitor, log_path, new_tokens = sys.argv[1:5]
    prompts = json.loads(sys.stdin.read())
    with SGLangServer(model, *CPU_ARGS, "--dtype", "float32", "--eaas", "--eaas-monitor",
                      monitor, "--eaas-transport", "mooncake", log_path=log_path) as server:
        tokens = [server.generate(p, int(new_tokens))["output_ids"] for p in prompts]
    print("tokens", json.dumps(tokens), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
