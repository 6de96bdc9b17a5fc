#!/usr/bin/env bash
# The whole GPU check, in as few device calls as possible. From the repo root on the GPU machine,
# carrying .whl (and .peer for the peer stage):
#   bash bench/gpu_check.sh parallel memory launch  # nvidia-h200-x2: NCCL layouts, fake-vs-real
#                                                   # memory, run_train.sh on 2 GPUs and fake 8B
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
    launch)  # run_train.sh on NCCL (FSDP 2, bf16 mixed precision, rank 1's log) and fake 8B on CUDA
      MODULE=bench.recipes CONFIG=bench_debugmodel NGPU=2 LOG_RANK=1 ./run_train.sh > "$LOGS/launch_fsdp2.log" 2>&1
      echo "run_train.sh NGPU=2 LOG_RANK=1 rc=$?"; grep -a '"event": "built"' "$LOGS/launch_fsdp2.log" | cut -c1-400
      grep -a '"event": "step"' "$LOGS/launch_fsdp2.log" | tail -1 | cut -c1-300
      echo "rank 0 lines: $(grep -ac '"rank": 0' "$LOGS/launch_fsdp2.log"), rank 1 lines: $(grep -ac '"rank": 1' "$LOGS/launch_fsdp2.log")"
      CONFIG=llama3_8b NGPU=64 COMM_BACKEND=fake ./run_train.sh > "$LOGS/fake_8b.log" 2>&1
      echo "llama3_8b as rank 0 of 64, fake, CUDA: rc=$?"; grep -a -A12 "memory report" "$LOGS/fake_8b.log" | tee "$OUT/fake_8b.txt" ;;
    peer) OUT=$LOGS/peer bash .peer/bench.sh "${PEER_DEADLINE:-330}"; cp "$LOGS/peer/summary.txt" "$OUT/peer.txt" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$LOGS" --exclude="*.pt" --exclude="*.distcp" --exclude="*.pickle" --exclude="events.*" . 2>/dev/null
