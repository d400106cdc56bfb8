#!/usr/bin/env bash
# Rerun every benchmark of docs/benchmarks.md, one after the other, then paste the reports into
# it (scripts/bench_paste.py). Prints each run's wall time and the total, so the doc can say how
# long a full rerun takes. Run it on an otherwise idle machine, on a committed tree (each
# report's header names the commit, '-dirty' otherwise).
#   bash scripts/bench_all.sh                    every benchmark
#   bash scripts/bench_all.sh fabric elastic     only the runs whose command contains one of
#                                                these words (then the paste, as always)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${SGLANG_EAAS_VENV:-$root/.venv}/bin/python"
paste_args=()
runs=(
  "scripts/bench_eaas.py"
  "scripts/bench_ablation.py"
  "scripts/bench_serving.py"
  "scripts/bench_expert_math.py"
  "scripts/bench_layer.py"
  "scripts/bench_p2p.py"
  "scripts/bench_faults.py"
  "scripts/bench_faults.py --fault stop --out .cache/bench/faults-stop.md"
  "scripts/bench_faults.py --fault replace --kills 2 --duration 40"
  "scripts/bench_faults.py --hog --memory-pressure 8"
  "scripts/bench_faults.py --hog 6 --sglang --fsync-writer --memory-pressure 8 --window 20"
  "scripts/bench_fabric.py"
  "scripts/bench_elastic.py"
  "scripts/bench_autoscale.py"
  "scripts/bench_switch.py"
  "scripts/bench_pd.py"
  "scripts/bench_balance.py"
  "scripts/bench_balance.py --no-live --shifts '' --batch 256 --requests-per-half 512 --out .cache/bench/balance-zipf256.md"
  "scripts/bench_balance.py --window 1 --no-live --shifts A:B --zipf 1.4 --out .cache/bench/balance-window1.md"
  "scripts/bench_balance_scale.py"
  "scripts/bench_dealing.py"
  "scripts/bench_live_balance.py"
  "scripts/bench_balance_shift.py"
  "scripts/bench_forecast_bound.py"
  "scripts/bench_balance_replay.py --seeds 5 --phases 10 --out .cache/bench/balance-replay.md"
  "scripts/bench_balance_replay.py --seeds 5 --phases 10 --output-len 160 --out .cache/bench/balance-replay-160.md"
  "scripts/bench_balance_replay.py --seeds 5 --phases 10 --policies reactive,predictive --recent-decay 1 --out .cache/bench/balance-replay-decay1.md"
  "scripts/bench_balance_replay.py --seeds 5 --phases 10 --output-len 160 --policies reactive,predictive --recent-decay 1 --out .cache/bench/balance-replay-160-decay1.md"
  "scripts/bench_esft.py"
  "scripts/bench_plan.py"
  "scripts/bench_plan_calibrate.py"
)
if (($#)); then
  picked=()
  for run in "${runs[@]}"; do
    for word in "$@"; do
      if [[ "$run" == *"$word"* ]]; then picked+=("$run"); break; fi
    done
  done
  if ((${#picked[@]} == 0)); then
    echo "bench_all: no benchmark's command contains any of: $*" >&2
    exit 2
  fi
  runs=("${picked[@]}")
  paste_args=(--present)  # the other blocks keep what they have
fi
began=$SECONDS
for run in "${runs[@]}"; do
  start=$SECONDS
  echo "bench_all: $run" >&2
  eval "\"$py\" $run"
  echo "bench_all: $run took $((SECONDS - start)) s" >&2
done
"$py" scripts/bench_paste.py "${paste_args[@]}"
echo "bench_all: every benchmark in $((SECONDS - began)) s ($(( (SECONDS - began) / 60 )) min)" >&2
