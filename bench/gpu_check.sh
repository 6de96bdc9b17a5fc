#!/usr/bin/env bash
# The whole GPU check, in as few device calls as possible. From the repo root on the GPU machine,
# carrying .whl (and .peer for the peer stage):
#   bash bench/gpu_check.sh parallel memory      # nvidia-h200-x2: NCCL layouts, fake-vs-real memory
#   bash bench/gpu_check.sh perf peer            # titan's benchmark and torchtitan's, same call
# PERF_RECIPES="bench_debugmodel bench_1b" picks the perf stage's recipes (default: all four).
set -u
source bench/setup_device.sh || exit 1
OUT=${OUT:-/tmp/titan_out}
LOGS=/tmp/titan_logs; mkdir -p "$OUT" "$LOGS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for stage in "$@"; do
  echo "== $stage ($(date +%T))"
  case $stage in
    parallel) python3 -m bench.gpu_parallel "$LOGS/parallel" 2>&1 | tee "$OUT/parallel.txt" ;;
    memory) python3 -m bench.gpu_memory "$LOGS/memory" 2>&1 | tee "$OUT/memory.txt" ;;
    perf)
      for r in ${PERF_RECIPES:-bench_debugmodel bench_1b bench_1b_compile bench_8b_l8_compile}; do
        timeout -k 10 200 python3 -m titan_core.cli run --module bench.recipes --recipe "$r" \
          > "$LOGS/titan_$r.log" 2>&1
        echo "$r rc=$?"; grep -a '"event": "step"' "$LOGS/titan_$r.log" | tail -1 | cut -c1-300
      done
      python3 bench/summarize.py "$LOGS"/titan_*.log | tee "$OUT/perf.txt" ;;
    peer) OUT=$LOGS/peer bash .peer/bench.sh "${PEER_DEADLINE:-330}"; cp "$LOGS/peer/summary.txt" "$OUT/peer.txt" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$LOGS" --exclude="*.pt" --exclude="*.distcp" --exclude="*.pickle" --exclude="events.*" . 2>/dev/null
