#!/usr/bin/env bash
# One command on a fresh machine: set up .venv, then run the whole test suite (what CI runs).
# Extra arguments go to pytest, e.g. 'bash scripts/test.sh -m "not slow"' for the fast set.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "${SGLANG_EAAS_VENV:-$root/.venv}/bin/python" -m pytest test "$@"
