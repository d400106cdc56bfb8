#!/usr/bin/env bash
# One command on a fresh machine: set up .venv, then run the whole test suite (what CI runs).
# Extra arguments go to pytest, e.g. 'bash scripts/test.sh -m "not slow"' for the fast set.
# The tests run on SGLANG_EAAS_TEST_WORKERS pytest-xdist workers (default 2; 0: in this process),
# a module at a time on each; much of a test is waiting on servers, so two share 2 cores well.
# The 25 longest tests are listed at the end (where the suite's time goes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "${SGLANG_EAAS_VENV:-$root/.venv}/bin/python" -m pytest test \
    -n "${SGLANG_EAAS_TEST_WORKERS:-2}" --dist loadfile --durations 25 "$@"
