#!/usr/bin/env bash
# scripts/gpu_check.sh: every GPU-only path of sglang-eaas, run once on a machine with one NVIDIA
# GPU, with only what that machine has (no SGLang, no network, no pip download). --help says more.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/gpu_check.sh [--imports-only] [--steps NAME,NAME...] [-h|--help]

Runs, from the repository root, every path of sglang-eaas that needs a GPU and writes what it saw:
  $OUT/gpu_check.log   every step's output (or .cache/gpu/ when OUT is unset)
  $OUT/gpu_check.md    a Markdown report: GPU, driver, CUDA, torch/triton versions, commit, date,
                       and each step's result, wall time and key numbers
Needs python3 with torch (CUDA), triton, pybind11, pytest and hypothesis, nvcc, and the
nvidia-nvshmem-cu13 wheel; installs nothing from the network. Steps on a GPU, in order:
  selection          the files run below are exactly test/'s files with tests marked gpu
  atomics            ibgda's host atomics built in place (setup.py build_ext --inplace)
  register           the package installed editable (pip --no-index --no-deps
                     --no-build-isolation) with the CPU runtime's start-up hook, which
                     test_cpu_runtime's gpu test looks for
  native             python -m ibgda.build_native for this GPU's sm_NN with NVSHMEM, then loaded
  cpu-kernel         the expert server's CPU kernel (python -m sgl_kernel_ext.cpu_ops)
  gpu-tests          pytest -m gpu on the files with gpu tests (native put/wait/read on device
                     memory, Triton rerouting on CUDA, the CPU runtime staying off)
  ipc                test_ibgda.py's device cases: a request/answer and a writer killed
                     mid-write between two processes over CUDA IPC
  graph              python -m gpu_lib.graph_step: the client's device step captured in one
                     CUDA graph, replayed across routing-table changes among the same servers,
                     bit-equal to the host path; eager vs replay time
  nvshmem            python -m gpu_lib.nvshmem_one_gpu: NVSHMEM job of one PE, put/wait/read
  triton-tests       test_kernel_ext.py and test_esft_reroute.py with the Triton kernels native
  device-step-tests  test_device_step.py natively (header kernels, real expert servers)
  timings            python -m gpu_lib.timings: device P2P round trip, grouped GEMM vs torch,
                     the device path's dealing of replicated experts
Each step has its own timeout, and all of them together stay inside GPU_CHECK_BUDGET seconds
(default 540), so the report is written before a 10-minute limit. A step whose prerequisite
failed is skipped. Exit status: 0 when every step passed, 1 otherwise.

Without a GPU (nvidia-smi lists none, or torch.cuda.is_available() is False) it says so in one
sentence, checks that every module and script it would run imports with the packages that machine
lacks hidden (SGLang, Mooncake, pyzmq, ...: scripts/gpu_lib/absent/sitecustomize.py) and that
the test selection collects, writes the report ("no GPU: nothing ran on a GPU; imports checked")
and exits 0, or 1 if a check failed.

options:
  --imports-only   run the no-GPU checks even where there is a GPU
  --steps LIST     run only these steps (comma-separated names above), e.g. for a rerun;
                   without a GPU, only these of its checks (selection, imports, scripts,
                   collect-gpu, collect-rest)
  -h, --help       this text
environment:
  OUT                      where the log and report go (default: .cache/gpu)
  PYTHON                   the interpreter (default: python3)
  GPU_CHECK_BUDGET         seconds all steps may take together (default 540)
  GPU_CHECK_COMMIT         the commit to report where there is no .git (a copied tree)
  GPU_CHECK_EXTRA_IMPORTS  more modules for the no-GPU import check (space-separated)
  GPU_CHECK_ABSENT         packages hidden from every Python it runs (comma-separated)
EOF
}

die() { echo "gpu_check: $*" >&2; exit 2; }

imports_only=0
only_steps=""
while (($#)); do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --imports-only) imports_only=1 ;;
    --steps) (($# > 1)) || die "--steps needs a comma-separated list of step names (see --help)"
             only_steps=$2; shift ;;
    --steps=*) only_steps=${1#--steps=} ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || die "'$PY' not found: set PYTHON=/path/to/python3"
BUDGET=${GPU_CHECK_BUDGET:-540}
[[ $BUDGET =~ ^[0-9]+$ ]] || die "GPU_CHECK_BUDGET='$BUDGET' is not a whole number of seconds"
OUT_DIR=${OUT:-$ROOT/.cache/gpu}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
REPORT=$OUT_DIR/gpu_check.md
STEP_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$STEP_DIR"' EXIT
: >"$LOG"

# Every Python process below: the repo's packages from the tree (nothing needs installing), the
# check's helpers, and the packages the lent GPU machine lacks hidden.
export PYTHONPATH="$ROOT/scripts/gpu_lib/absent:$ROOT/python:$ROOT:$ROOT/sgl-kernel-ext:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export SGLANG_EAAS_TOKEN=${SGLANG_EAAS_TOKEN:-gpu-check-token}
unset TRITON_INTERPRET  # the CPU twin's switch: nothing here may run interpreted on a GPU

GPU_MARKED_FILES=(test/test_cpu_runtime.py test/test_esft_reroute.py test/test_ibgda_native.py)
TRITON_FILES=(test/test_kernel_ext.py test/test_esft_reroute.py)
PYTEST=("$PY" -m pytest -p no:cacheprovider -q)
# cpu_only tests are deselected rather than skipped: on a GPU host every selected test must run
NOT_CPU_ONLY="-m 'not cpu_only'"

# name | prerequisite steps | timeout s | what it proves | command (run by bash -c)
STEPS=(
  "selection||30|the GPU run covers every test marked gpu|$PY -m gpu_lib.selection ${GPU_MARKED_FILES[*]}"
  "atomics||120|ibgda's native host atomics build in place (setup.py build_ext --inplace)|$PY setup.py -q build_ext --inplace && $PY -c 'import ibgda._host_atomics'"
  "register|atomics|120|the package installs as the project installs it (editable, no index, no dependencies) with the CPU runtime's start-up hook|$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . && $PY -m sglang_eaas.cpu_runtime install"
  "native|atomics|240|the device backend's CUDA IPC and NVSHMEM kernels (pybind11) compile for this GPU and load|$PY -m ibgda.build_native --arch \$GPU_ARCH --nvshmem on && $PY -c 'import ibgda._device_cuda as m; print(\"RESULT: module=\" + m.__file__.rsplit(\"/\", 1)[-1] + \", HAS_NVSHMEM=\" + str(m.HAS_NVSHMEM))'"
  "cpu-kernel|atomics|240|the expert servers' CPU kernel builds|$PY -m sgl_kernel_ext.cpu_ops"
  "gpu-tests|native|180|every test marked gpu passes: native put_signal/wait_flag/read on device memory, Triton rerouting on CUDA, the CPU runtime off on a GPU host|${PYTEST[*]} -m gpu ${GPU_MARKED_FILES[*]}"
  "ipc|native|120|the device backend's round trip and torn-write safety between two processes over CUDA IPC|${PYTEST[*]} $NOT_CPU_ONLY test/test_ibgda.py -k device"
  "graph|native cpu-kernel|180|the client's device step captured in one CUDA graph replays across routing-table changes among the same servers, bit-equal to the host path|$PY -m gpu_lib.graph_step --server-log $OUT_DIR/graph_step_servers.log"
  "nvshmem|native|90|NVSHMEM initialises on one GPU and its put/wait/read kernels run (a job of one PE)|$PY -m gpu_lib.nvshmem_one_gpu"
  "triton-tests|cpu-kernel|240|the Triton kernels (group shrink, static grid, grouped GEMM, ESFT rerouting) run natively and equal the references the CPU tests use|${PYTEST[*]} $NOT_CPU_ONLY ${TRITON_FILES[*]}"
  "device-step-tests|native cpu-kernel|240|the client's device path natively: header kernels equal the host's struct code, exchanges with real expert servers equal the host path, failures reach the host|${PYTEST[*]} $NOT_CPU_ONLY test/test_device_step.py"
  "timings|native|150|device P2P round trip (vs shm and memcpy), the grouped expert GEMM (Triton vs torch) and the device path's dealing of replicated experts (equal to the host's, then timed) on this GPU|$PY -m gpu_lib.timings"
)
step_field() { local IFS='|'; read -r -a f <<<"$1"; echo "${f[$2]}"; }
step_command() { echo "${1#*|*|*|*|}"; }
NO_GPU_CHECKS=(selection imports scripts collect-gpu collect-rest)
STEP_NAMES=()
for s in "${STEPS[@]}"; do STEP_NAMES+=("$(step_field "$s" 0)"); done
if [[ -n $only_steps ]]; then
  for name in ${only_steps//,/ }; do
    [[ " ${STEP_NAMES[*]} ${NO_GPU_CHECKS[*]} " == *" $name "* ]] || die "--steps: '$name' is \
not a step (on a GPU: ${STEP_NAMES[*]}; without one: ${NO_GPU_CHECKS[*]})"
  done
fi
wanted() { [[ -z $only_steps || ",$only_steps," == *",$1,"* ]]; }

say() { echo "gpu_check: $*" | tee -a "$LOG"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

commit() {
  if [[ -n ${GPU_CHECK_COMMIT:-} ]]; then echo "$GPU_CHECK_COMMIT"; return; fi
  local sha
  if sha=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); then
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null || sha="$sha-dirty"
    echo "$sha"
  else
    echo "unknown (no .git in this tree; set GPU_CHECK_COMMIT)"
  fi
}

versions() {
  "$PY" - <<'EOF' 2>/dev/null || echo "python/torch/triton versions: could not be read"
import platform, torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "missing"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {tv}")
EOF
}

# The one sentence of a machine without a GPU (empty where there is one).
no_gpu_reason() {
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "nvidia-smi is missing or lists no GPU"
  elif ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "torch.cuda.is_available() is False"
  fi
}

RESULTS=()  # name|result|wall s|key numbers
SKIPS_FAIL=0  # on a GPU: a pytest step that skipped a test failed

# run NAME TIMEOUT COMMAND: its output to the log and $STEP_DIR/NAME.out; records the result.
run() {
  local name=$1 limit=$2 command=$3 started rc result
  started=$(now)
  say "--- $name (timeout ${limit}s): $command"
  set +e
  timeout --kill-after=15 "$limit" bash -c "$command" </dev/null 2>&1 \
    | tee "$STEP_DIR/$name.out" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  set -e
  if ((rc == 0 && SKIPS_FAIL)) && grep -qE '(^|[ ,=])[0-9]+ skipped.* in [0-9.]+s' \
      "$STEP_DIR/$name.out"; then
    rc=3  # a test skipped on a GPU host proves nothing about the GPU
  fi
  case $rc in
    0) result=passed ;;
    3) result="FAILED (tests were skipped; on a GPU every selected test must run)" ;;
    124|137) result="FAILED (timed out after ${limit}s)" ;;
    *) result="FAILED (exit $rc)" ;;
  esac
  RESULTS+=("$name|$result|$(since "$started")|$(key_numbers "$STEP_DIR/$name.out")")
  say "--- $name: $result"
  [[ $rc == 0 ]]
}

# RESULT lines of our scripts, and pytest's summary line.
key_numbers() {
  { grep -E '^RESULT: ' "$1" | sed -E 's/^RESULT: //' | cut -c1-300
    grep -E '^(=+ )?[0-9].* in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$1" | tail -1 \
      | sed -E 's/^=+ //; s/ =+$//'
    grep -E '^(imports|selection): ' "$1" | tail -2
  } | sed 's/|/\\|/g' | awk 'NR > 1 { printf "; " } { printf "%s", $0 }'
}

report_header() {
  local title=$1
  echo "# GPU check: $title"
  echo
  echo "- command: \`bash scripts/gpu_check.sh${*:2}\`"
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(commit); host: $(hostname)"
  echo "- $(versions)"
}

results_table() {
  echo "| step | result | wall s | key numbers |"
  echo "|---|---|---:|---|"
  local r f
  for r in "${RESULTS[@]}"; do
    IFS='|' read -r -a f <<<"$r"
    echo "| ${f[0]} | ${f[1]} | ${f[2]} | ${f[3]:-} |"
  done
}

failed_outputs() {
  local r name
  for r in "${RESULTS[@]}"; do
    name=${r%%|*}
    if [[ $r == *"|FAILED"* && -f $STEP_DIR/$name.out ]]; then
      echo
      echo "### $name: the last 40 lines"
      echo
      echo '```'
      tail -40 "$STEP_DIR/$name.out"
      echo '```'
    fi
  done
}

# ------------------------------------------------------------------ without a GPU: imports only
no_gpu_checks() {
  local sentence=$1 failed=0
  echo "$sentence" | tee -a "$LOG"
  if wanted selection; then
    run selection 60 "$PY -m gpu_lib.selection ${GPU_MARKED_FILES[*]}" || failed=1
  fi
  if wanted imports; then
    run imports 120 "$PY -m gpu_lib.imports ${GPU_CHECK_EXTRA_IMPORTS:-}" || failed=1
  fi
  if wanted scripts; then
    run scripts 120 "bash -n scripts/gpu_check.sh \
&& $PY -m py_compile scripts/gpu_lib/*.py scripts/gpu_lib/absent/sitecustomize.py \
&& $PY -m sglang_eaas.expert_server --help >/dev/null && $PY -m ibgda.build_native --help >/dev/null \
&& $PY -m gpu_lib.graph_step --help >/dev/null && $PY -m gpu_lib.nvshmem_one_gpu --help >/dev/null \
&& $PY -m gpu_lib.timings --help >/dev/null \
&& echo 'RESULT: compiled and --help ran: gpu_check.sh, gpu_lib/*, expert_server, build_native'" \
      || failed=1
  fi
  if wanted collect-gpu; then
    run collect-gpu 120 "${PYTEST[*]} --collect-only -m gpu ${GPU_MARKED_FILES[*]}" || failed=1
  fi
  if wanted collect-rest; then
    run collect-rest 120 "${PYTEST[*]} --collect-only $NOT_CPU_ONLY ${TRITON_FILES[*]} \
test/test_device_step.py test/test_ibgda.py -k 'not test_ibgda.py or device'" || failed=1
  fi
  {
    report_header "no GPU" "${ARGS_TEXT}"
    echo
    if ((failed)); then
      echo "**no GPU: nothing ran on a GPU; imports checked, and a check FAILED (below).**"
    else
      echo "**no GPU: nothing ran on a GPU; imports checked.**"
    fi
    echo
    echo "${sentence#gpu_check: }"
    echo
    echo "## Checks run here"
    echo
    results_table
    echo
    echo "## Steps a GPU run takes (none ran here)"
    echo
    echo "| step | needs | timeout s | what it proves | command |"
    echo "|---|---|---:|---|---|"
    local s f
    for s in "${STEPS[@]}"; do
      IFS='|' read -r -a f <<<"$s"
      echo "| ${f[0]} | ${f[1]:--} | ${f[2]} | ${f[3]} | \`$(step_command "$s" | cut -c1-300)\` |"
    done
    echo
    echo "## To run it on a lent GPU"
    echo
    echo "One \`device\` call from the repository root (the tests' tiny model travels along, so"
    echo "that machine need not generate it):"
    echo
    echo '```'
    echo "run(command=\"GPU_CHECK_COMMIT=$(commit) GPU_CHECK_BUDGET=420 bash scripts/gpu_check.sh\","
    echo "    carry=[\"$(tiny_model)\"], timeout_s=480)"
    echo '```'
    failed_outputs
  } >"$REPORT"
  say "report: $REPORT"
  results_table
  return $failed
}

# The tests' tiny model under .cache/models (made here if missing: seconds).
tiny_model() {
  "$PY" - <<'EOF' 2>/dev/null || echo ".cache/models/(the tiny model: see test/conftest.py)"
from pathlib import Path
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
print(cached_model(Path(".cache/models"), PRESETS["tiny"], log=lambda _: None))
EOF
}

# ------------------------------------------------------------------------------- on a GPU
find_nvcc() {
  if [[ -n ${CUDA_HOME:-} ]] || command -v nvcc >/dev/null; then return; fi
  local candidate
  for candidate in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    if [[ -x $candidate ]]; then
      export CUDA_HOME=${candidate%/bin/nvcc}
      return
    fi
  done
}

gpu_checks() {
  SKIPS_FAIL=1
  find_nvcc
  GPU_ARCH=$("$PY" -c 'import torch; print("sm_%d%d" % torch.cuda.get_device_capability())') \
    || GPU_ARCH=sm_90
  export GPU_ARCH
  local gpu nvcc_version
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        2>/dev/null | head -1 || true)
  gpu=${gpu:-"a GPU nvidia-smi did not describe"}
  nvcc_version=$("${CUDA_HOME:+$CUDA_HOME/bin/}nvcc" --version 2>/dev/null | tail -1 || true)
  say "GPU: $gpu ($GPU_ARCH); nvcc: ${nvcc_version:-not found}; $(versions)"
  local started=$SECONDS failed=0 s name needs limit left dep
  declare -A outcome=()
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name needs limit _ <<<"$s"
    wanted "$name" || continue
    for dep in $needs; do
      if [[ ${outcome[$dep]:-} == failed ]]; then
        RESULTS+=("$name|skipped ($dep failed)|0|")
        outcome[$name]=failed
        failed=1
        say "--- $name: skipped, $dep failed"
        continue 2
      fi
    done
    left=$((BUDGET - (SECONDS - started) - 10))
    if ((left < 20)); then
      RESULTS+=("$name|not run (the ${BUDGET}s budget is spent)|0|")
      outcome[$name]=failed
      failed=1
      continue
    fi
    ((limit <= left)) || limit=$left
    if run "$name" "$limit" "$(step_command "$s")"; then
      outcome[$name]=passed
    else
      outcome[$name]=failed
      failed=1
    fi
    write_gpu_report "$gpu" "$nvcc_version"  # after every step: a killed run leaves one too
  done
  for log in .cache/logs/test/device-step-servers.log; do
    [[ -f $log ]] && cp "$log" "$OUT_DIR/" || true
  done
  write_gpu_report "$gpu" "$nvcc_version"
  say "report: $REPORT"
  results_table  # last, so the end of the output holds the summary
  return $failed
}

write_gpu_report() {
  {
    report_header "$1" "${ARGS_TEXT}"
    echo "- GPU: $1 ($GPU_ARCH); nvcc: ${2:-not found}"
    echo
    results_table
    echo
    echo "What each step proves:"
    echo
    local s f
    for s in "${STEPS[@]}"; do
      IFS='|' read -r -a f <<<"$s"
      echo "- **${f[0]}**: ${f[3]}"
    done
    failed_outputs
  } >"$REPORT"
}

ARGS_TEXT=""
((imports_only)) && ARGS_TEXT+=" --imports-only"
[[ -n $only_steps ]] && ARGS_TEXT+=" --steps $only_steps"
if ((imports_only)); then
  no_gpu_checks "gpu_check: --imports-only, so nothing runs on the GPU: checking that every piece imports and that the test selection collects."
elif reason=$(no_gpu_reason) && [[ -n $reason ]]; then
  no_gpu_checks "gpu_check: no GPU here ($reason), so nothing runs on a GPU: checking that every piece imports and that the test selection collects."
else
  gpu_checks
fi
