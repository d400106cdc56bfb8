#!/usr/bin/env bash
# One command on a fresh machine: set up .venv, then run the demo (scripts/demo.py).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "${SGLANG_EAAS_VENV:-$root/.venv}/bin/python" "$root/scripts/demo.py" "$@"
