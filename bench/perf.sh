#!/usr/bin/env bash
# titan against torchtitan 0.3.0 on one H200, and a hand-written loop on titan's model; one table.
# From the repo root on a warm nvidia-h200 machine, carrying .whl and .peer (bench/README.md says
# how to fill them here):
#
#   bash bench/perf.sh [STAGE ...]
#
# Stages, run in the order given (default: titan hand peer table):
#   titan[:CONFIG]  titan run --module bench.recipes --recipe CONFIG (default: the four configs)
#   float8          titan's 8B shape with float8 linear layers, tensorwise and rowwise (torchao
#                   from .whl); the table compares them with titan:bench_8b_l8_compile (bf16)
#   hand[:CONFIG]   python3 -m bench.handloop --config CONFIG (default: the two compiled ones)
#   peer            .peer/bench.sh, torchtitan 0.3.0's four runs of the same shapes
#   check           python3 -m bench.gpu_perf_check (flex/GQA/recompile/1-GPU FSDP checks)
#   float8check     python3 -m bench.gpu_float8_check (torchao on this torch, float8 numerics,
#                   compiled float8 blocks, selective AC keeping flex attention and _scaled_mm)
#   table           python3 bench/perf_table.py over everything measured on this machine
#
# The whole benchmark takes about 15 minutes, so it is meant for two back-to-back calls on the
# same warm machine (state is kept in /tmp/titan_perf between them; each call stops its runs
# before PERF_DEADLINE seconds, default 570):
#   call 1: bash bench/perf.sh titan hand:bench_1b_compile table
#   call 2: bash bench/perf.sh hand:bench_8b_l8_compile peer table
# The table of call 2 then holds every row; each call also leaves its logs under $OUT/logs, and
# `python3 bench/perf_table.py DIR1 DIR2` rebuilds the table from the two calls' logs anywhere.
set -u
T0=$(date +%s)
DEADLINE=${PERF_DEADLINE:-570}
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
W=/tmp/titan_perf
OUT=${OUT:-$W/out}
mkdir -p "$W/data" "$OUT/logs"
CALL=${PERF_CALL:-call@$(date +%H:%M:%S)}

source bench/setup_device.sh > "$W/setup.log" 2>&1 || { cat "$W/setup.log"; exit 1; }
# torchao for the float8 configs (one carried wheel; its CUDA extensions are not needed by float8
# training, a failure to load them is only logged).
for whl in .whl/torchao-*.whl; do
  [ -f "$whl" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$whl" >> "$W/setup.log" 2>&1
done
tail -n 3 "$W/setup.log"
# The same allocator setting as .peer/bench.sh gives torchtitan (it changes reserved memory).
export PYTORCH_ALLOC_CONF=expandable_segments:True
# The peer kit's data (same generator and seed as its c4_test) and tokenizer (2048 tokens).
[ -s "$W/data/c4_test.jsonl" ] || python3 .peer/make_data.py "$W/data/c4_test.jsonl" 2000
export TITAN_BENCH_DATA=$W/data/c4_test.jsonl TITAN_BENCH_TOKENIZER=$PWD/.peer/tokenizer/tokenizer.json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

TITAN_CONFIGS="bench_debugmodel bench_1b bench_1b_compile bench_8b_l8_compile"
HAND_CONFIGS="bench_1b_compile bench_8b_l8_compile"
FLOAT8_CONFIGS="bench_8b_l8_compile_float8 bench_8b_l8_compile_float8_rowwise"
declare -A CAP=([bench_debugmodel]=150 [bench_1b]=230 [bench_1b_compile]=200 [bench_8b_l8_compile]=220
  [bench_8b_l8_compile_float8]=220 [bench_8b_l8_compile_float8_rowwise]=220)

capped() { # capped NAME CAP CMD... -> $W/NAME.log; skipped when too little time is left
  local name=$1 cap=$2
  shift 2
  local l
  l=$(left)
  local t=$((cap < l ? cap : l))
  if [ "$t" -lt 60 ]; then
    echo "== $name SKIPPED: ${l}s left in this call (run it in the next one)"
    return 2
  fi
  echo "== $name (cap ${t}s, $(date +%T))"
  local s
  s=$(date +%s)
  timeout -k 10 "$t" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  echo "$name $CALL rc=$rc wall=$(($(date +%s) - s))s" | tee -a "$W/calls.txt"
  grep -a '"event": "step"' "$W/$name.log" | tail -n 1 | cut -c1-240
  [ $rc -eq 0 ] || grep -aE "Error|error:" "$W/$name.log" | tail -n 3 | cut -c1-300
  return $rc
}

for stage in "${@:-titan hand peer table}"; do
  for st in $stage; do
    name=${st%%:*}
    arg=${st#*:}
    [ "$arg" = "$st" ] && arg=""
    case $name in
      titan)
        for c in ${arg:-$TITAN_CONFIGS}; do
          capped "titan_$c" "${CAP[$c]}" python3 -m titan_core.cli run --module bench.recipes --recipe "$c"
        done ;;
      float8)
        for c in ${arg:-$FLOAT8_CONFIGS}; do
          capped "titan_$c" "${CAP[$c]}" python3 -m titan_core.cli run --module bench.recipes --recipe "$c"
        done ;;
      hand)
        for c in ${arg:-$HAND_CONFIGS}; do
          capped "hand_$c" "${CAP[$c]}" python3 -m bench.handloop --config "$c"
        done ;;
      check) capped check 240 python3 -m bench.gpu_perf_check; cat "$W/check.log" | grep -aE "^(PASS|FAIL)|checks passed" ;;
      peer)
        l=$(($(left) - 15))
        echo "== peer: torchtitan 0.3.0 (deadline ${l}s, $(date +%T))"
        OUT=$W/peer bash .peer/bench.sh "$l" > "$W/peer.log" 2>&1
        echo "peer $CALL rc=$?" | tee -a "$W/calls.txt"
        tail -n 8 "$W/peer/summary.txt" 2>/dev/null ;;
      table)
        python3 bench/perf_table.py "$W" | tee "$OUT/perf_table.md"
        echo "calls:"; cat "$W/calls.txt" ;;
      float8check) capped float8check 240 python3 -m bench.gpu_float8_check; grep -aE "^(PASS|FAIL)|checks passed" "$W/float8check.log" ;;
      *) echo "unknown stage $st (titan[:CONFIG] float8[:CONFIG] hand[:CONFIG] peer check float8check table)"; exit 2 ;;
    esac
  done
done
cp "$W"/*.log "$W"/calls.txt "$OUT/logs/" 2>/dev/null
[ -d "$W/peer" ] && mkdir -p "$OUT/logs/peer" && cp "$W"/peer/*.log "$W"/peer/summary.txt "$OUT/logs/peer/" 2>/dev/null
echo "== done in $(($(date +%s) - T0))s"
