"""Demo: SGLang + sglang-eaas on a tiny MoE model, experts on local expert servers, one request.

Run through ``bash scripts/demo.sh`` (which sets up .venv first) or, inside the venv,
``python scripts/demo.py``. The model is the committed ``models/tiny-moe-stdlib`` (a Qwen3-MoE
trained on the CPython standard library's sources by ``sglang_eaas.tools.train_tiny_moe``,
docs/tiny-models.md), so it continues Python code; it is a 9M-parameter model, so expect
plausible-looking code, not correct code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_eaas import cpu_runtime
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-moe-stdlib"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default='def read_config(path):\n    """',
                        help="text to continue (the model knows Python source)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument("--expert-servers", type=int, default=2,
                        help="local expert servers to run the routed experts on; 0 serves "
                        "monolithically (experts inside SGLang)")
    args = parser.parse_args()

    model = MODEL
    if not (model / "config.json").exists():
        print(f"demo: error: {model} is missing (it is committed with the repository)",
              file=sys.stderr)
        return 1
    print(f"demo: [1/4] trained tiny Qwen3-MoE checkpoint {model.relative_to(ROOT)} "
          "(4 layers, 32 experts, top-4)")
    server_args = CPU_ARGS if cpu_runtime.is_active() else ()
    if args.expert_servers:
        server_args += ("--eaas", "--eaas-expert-servers", f"local:{args.expert_servers}")
    print(f"demo: [2/4] starting SGLang on {model.name} with {args.expert_servers} local expert "
          "servers (about 40 s on 2 CPU cores)")
    log_path = ROOT / ".cache" / "logs" / "demo-server.log"
    try:
        with SGLangServer(model, *server_args, log_path=log_path) as server:
            print(f"demo: [3/4] POST {server.url}/generate (greedy): {args.prompt!r}")
            reply = server.generate(args.prompt, max_new_tokens=args.max_tokens)
            print(json.dumps(reply["meta_info"], indent=2))
            print("demo: [4/4] the prompt and its continuation:")
            print(args.prompt + reply["text"])
        print(f"demo: server and expert servers stopped cleanly (log: {log_path})")
    except ServerError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
