"""Demo: SGLang + sglang-eaas on a tiny MoE model, experts on local expert servers, one request.

Run through ``bash scripts/demo.sh`` (which sets up .venv first) or, inside the venv,
``python scripts/demo.py``. Generates the model into .cache/models on first use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_eaas import cpu_runtime
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Tell me a story about a robot.", help="user message")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens to generate")
    parser.add_argument("--expert-servers", type=int, default=2,
                        help="local expert servers to run the routed experts on; 0 serves "
                        "monolithically (experts inside SGLang)")
    args = parser.parse_args()

    print("demo: [1/4] tiny Qwen3-MoE checkpoint (generated once, cached in .cache/models)")
    model = cached_model(ROOT / ".cache" / "models", PRESETS["tiny"], log=lambda m: print("  " + m))
    server_args = CPU_ARGS if cpu_runtime.is_active() else ()
    if args.expert_servers:
        server_args += ("--eaas", "--eaas-expert-servers", f"local:{args.expert_servers}")
    print(f"demo: [2/4] starting SGLang on {model.name} with {args.expert_servers} local expert "
          "servers (about 40 s on 2 CPU cores)")
    log_path = ROOT / ".cache" / "logs" / "demo-server.log"
    try:
        with SGLangServer(model, *server_args, log_path=log_path) as server:
            print(f"demo: [3/4] POST {server.url}/v1/chat/completions: {args.prompt!r}")
            reply = server.chat(args.prompt, max_tokens=args.max_tokens)
            print(json.dumps(reply, indent=2))
            print("demo: [4/4] answer (random weights, so the words are noise):")
            print("  " + repr(reply["choices"][0]["message"]["content"]))
        print(f"demo: server and expert servers stopped cleanly (log: {log_path})")
    except ServerError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
