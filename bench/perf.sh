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
#   rope            python3 -m bench.rope_eager: eager RoPE's complex multiply against its real form
#   float8check     python3 -m bench.gpu_float8_check (torchao on this torch, float8 numerics,
#                   compiled float8 blocks, selective AC keeping flex attention and _scaled_mm)
#   profile[:CONFIG] titan and the hand loop on CONFIG (default bench_8b_l8_compile), 10 steps each,
#                   step 9 traced by torch.profiler; bench/trace_summary.py prints where each
#                   step's time goes (GPU busy and idle, time by kernel kind, the longest gaps)
#   ablate[:CONFIG] what each optimisation buys on CONFIG (default bench_8b_l8_compile): the hand
#                   loop with each --without NAME against itself (10 steps each), titan with
#                   data.prefetch 0 and with a log line every 5 steps against itself (20 steps);
#                   prints bench/perf_table.py --ablation
#   recompute[:CONFIG] titan on CONFIG (default bench_8b_l8_compile) with activation_checkpoint.mode
#                   = memory_budget at each budget of PERF_BUDGETS (default: bench/perf_table.py's
#                   BUDGETS; bench/recompute_plan.py says what each saves and recomputes), and
#                   the hand loop with the same budget when PERF_HAND=1; under one-GPU FSDP2, or
#                   autocast with TITAN_BENCH_MIXED_PRECISION=autocast; prints perf_table.py
#                   --recompute
#   peer_budget     torchtitan 0.3.0's 8B-shape run with its memory_budget mode at each budget of
#                   PERF_BUDGETS (bench/peer_recompute.py), beside titan's budget runs
#   peer1[:RUN]     one of the peer kit's runs alone (r1_debugmodel_ce_loss, r2_1b_v2k_eager, r3_1b_v2k_compile (default),
#                   r4_8b_l8_v2k_compile), the kit's settings, for a short lease; with TITAN_BENCH_AC=full
#                   or none, in that activation-checkpoint mode (log name RUN_full, RUN_none)
#   table           python3 bench/perf_table.py over everything measured on this machine
#
# TITAN_BENCH_AC, TITAN_BENCH_MEMORY_BUDGET and TITAN_BENCH_MIXED_PRECISION choose the
# recomputation and the one-GPU mixed precision for titan and the hand loop alike; a run with
# anything but selective AC under FSDP2 logs under a name that says so (variant below).
# The whole benchmark takes about 25 minutes, so it is meant for three back-to-back calls on the
# same warm machine (state is kept in /tmp/titan_perf between them; each call stops its runs
# before PERF_DEADLINE seconds, default 570). titan and the hand loop run back to back on each
# shape, so that both meet the GPU in the same thermal state:
#   call 1: bash bench/perf.sh titan:bench_debugmodel titan:bench_1b titan:bench_1b_compile \
#             hand:bench_1b_compile titan:bench_8b_l8_compile hand:bench_8b_l8_compile table
#   call 2: bash bench/perf.sh peer float8:bench_8b_l8_compile_float8_rowwise table
#   call 3: bash bench/perf.sh ablate float8:bench_8b_l8_compile_float8 table
# The table of the last call then holds every row; each call also leaves its logs under $OUT/logs, and
# `python3 bench/perf_table.py DIR1 DIR2` rebuilds the table from the two calls' logs anywhere.
# PERF_STOP_ON_FAIL=1 ends a call at its first failed run.
# PERF_SKIP_DONE=1 skips the runs that finished (rc=0) in an earlier call on this machine: one
# command, repeated on the warm machine, completes a lease whatever each call got through.
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
  # PERF_SKIP_DONE=1: a run that already finished in an earlier call of this lease is not rerun, so
  # that every call of a lease can be the same command (a call taken back loses only its own runs).
  if [ "${PERF_SKIP_DONE:-0}" = 1 ] && grep -q "^$name .* rc=0 " "$W/calls.txt" 2>/dev/null; then
    echo "== $name: done in an earlier call"
    return 0
  fi
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
  if [ $rc -ne 0 ]; then
    grep -aE "Error|error:" "$W/$name.log" | tail -n 3 | cut -c1-300
    # PERF_STOP_ON_FAIL=1: a failed run ends the call (the device time is not spent on the rest).
    [ "${PERF_STOP_ON_FAIL:-0}" = 1 ] && { echo "== stopping: $name failed"; finish; exit 1; }
  fi
  return $rc
}

variant() { # the log-name suffix of the environment's recomputation and mixed precision
  local v=""
  [ "${TITAN_BENCH_AC:-selective}" = selective ] || v="_${TITAN_BENCH_AC}"
  [ "${TITAN_BENCH_AC:-}" = memory_budget ] && v="_budget${TITAN_BENCH_MEMORY_BUDGET:-0.5}"
  [ "${TITAN_BENCH_MIXED_PRECISION:-fsdp}" = autocast ] && v="${v}_autocast"
  [ "${TITAN_BENCH_RESHARD:-default}" = default ] || v="${v}_reshard_${TITAN_BENCH_RESHARD}"
  [ -z "${TITAN_BENCH_FUSE_W13:-}" ] || v="${v}_w13_${TITAN_BENCH_FUSE_W13}"
  echo "$v"
}
peer_run() { # peer_run NAME ARGS...: one torchtitan run in the peer kit's environment -> $W/peer/NAME.log
  local name=$1
  shift
  [ -d /tmp/site/torchtitan ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl >> "$W/setup.log" 2>&1
  mkdir -p "$W/peer"
  (
    cd .peer && mkdir -p tests/assets/tokenizer tests/assets/c4_test && cp tokenizer/* tests/assets/tokenizer/
    [ -s tests/assets/c4_test/data.json ] || python3 make_data.py tests/assets/c4_test/data.json 2000
    export PYTHONPATH=/tmp/site:$PWD/pkg:$OLDPWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
    capped "peer/$name" 220 python3 -m torch.distributed.run --nproc_per_node=1 --rdzv_backend c10d \
      --rdzv_endpoint=localhost:0 pkg/run_tt.py "$@" --training.disable_cuda_graphs
  )
}
budgets() { echo "${PERF_BUDGETS:-$(python3 -c "from bench.perf_table import BUDGETS; print(*BUDGETS)")}"; }

finish() { # the logs of this call under $OUT/logs
  cp "$W"/*.log "$W"/calls.txt "$OUT/logs/" 2>/dev/null
  [ -d "$W/peer" ] && mkdir -p "$OUT/logs/peer" && cp "$W"/peer/*.log "$W"/peer/summary.txt "$OUT/logs/peer/" 2>/dev/null
  echo "== done in $(($(date +%s) - T0))s"
}

for stage in "${@:-titan hand peer table}"; do
  for st in $stage; do
    name=${st%%:*}
    arg=${st#*:}
    [ "$arg" = "$st" ] && arg=""
    case $name in
      titan)
        for c in ${arg:-$TITAN_CONFIGS}; do
          capped "titan_$c$(variant)" "${CAP[$c]}" python3 -m titan_core.cli run --module bench.recipes --recipe "$c" \
            --dump-folder "outputs/bench/$c$(variant)" --overwrite
        done ;;
      float8)
        for c in ${arg:-$FLOAT8_CONFIGS}; do
          capped "titan_$c" "${CAP[$c]}" python3 -m titan_core.cli run --module bench.recipes --recipe "$c"
        done ;;
      hand)
        for c in ${arg:-$HAND_CONFIGS}; do
          capped "hand_$c$(variant)" "${CAP[$c]}" python3 -m bench.handloop --config "$c"
        done ;;
      profile)
        c=${arg:-bench_8b_l8_compile}
        TITAN_BENCH_PROFILE_STEP=9 capped "profile_titan_$c" 240 python3 -m titan_core.cli run --module bench.recipes --recipe "$c" \
          --dump-folder "outputs/profile/$c" --overwrite
        capped "profile_hand_$c" 240 python3 -m bench.handloop --config "$c" --steps 10 --trace "$W/hand_trace_$c.json"
        python3 bench/trace_summary.py "outputs/profile/$c/profile_traces/iteration_9/rank0_trace.json" "$W/hand_trace_$c.json" \
          | tee "$OUT/profile_$c.md" ;;
      ablate)
        c=${arg:-bench_8b_l8_compile}
        capped "ablate_hand_$c" 150 python3 -m bench.handloop --config "$c" --steps 10
        for w in document_mask fuse_qkv fuse_w13 gqa fsdp fused_adamw compile autotune; do
          capped "ablate_hand_without_${w}_$c" 150 python3 -m bench.handloop --config "$c" --steps 10 --without "$w"
        done
        for v in titan= titan_prefetch0=TITAN_BENCH_PREFETCH=0 titan_logfreq5=TITAN_BENCH_LOG_FREQ=5; do
          (
            [ -n "${v#*=}" ] && export "${v#*=}"
            capped "ablate_${v%%=*}_$c" 150 python3 -m titan_core.cli run --module bench.recipes --recipe "$c" \
              --dump-folder "outputs/ablate/${v%%=*}" --overwrite
          )
        done
        python3 bench/perf_table.py --ablation "$c" "$W" | tee "$OUT/ablation_$c.md" ;;
      recompute)
        c=${arg:-bench_8b_l8_compile}
        for b in $(budgets); do
          (
            export TITAN_BENCH_AC=memory_budget TITAN_BENCH_MEMORY_BUDGET=$b
            capped "titan_$c$(variant)" "${CAP[$c]}" python3 -m titan_core.cli run --module bench.recipes \
              --recipe "$c" --dump-folder "outputs/recompute/$c$(variant)" --overwrite
            [ "${PERF_HAND:-0}" = 1 ] && capped "hand_$c$(variant)" "${CAP[$c]}" python3 -m bench.handloop --config "$c"
          )
        done
        python3 bench/perf_table.py --recompute "$c" "$W" | tee "$OUT/recompute_$c.md" ;;
      peer_budget)
        for b in $(budgets); do
          (export TITAN_BENCH_AC=memory_budget TITAN_BENCH_MEMORY_BUDGET=$b && peer_run "r4_8b_l8_v2k_compile_budget$b" --module bench.peer_recompute \
            --config llama3_8b_l8_v2k --training.steps 20 --training.local_batch_size 4 --compile.enable)
        done ;;
      peer1)
        # TITAN_BENCH_AC=full or none runs torchtitan in that activation-checkpoint mode too.
        pv="" pm=peer_llama_configs
        case ${TITAN_BENCH_AC:-selective} in
          full | none) pv="_${TITAN_BENCH_AC}" pm=bench.peer_recompute ;;
        esac
        for r in ${arg:-r3_1b_v2k_compile}; do
          case $r in
            r1_debugmodel_ce_loss) peer_run "$r$pv" --module llama3 --config llama3_debugmodel_ce_loss --training.steps 30 ;;
            r2_1b_v2k_eager) peer_run "$r$pv" --module $pm --config llama3_1b_v2k --training.steps 30 ;;
            r3_1b_v2k_compile) peer_run "$r$pv" --module $pm --config llama3_1b_v2k --training.steps 30 \
              --compile.enable ;;
            r4_8b_l8_v2k_compile) peer_run "$r$pv" --module $pm --config llama3_8b_l8_v2k --training.steps 20 \
              --training.local_batch_size 4 --compile.enable ;;
            *) echo "unknown peer run $r (r1_debugmodel_ce_loss r2_1b_v2k_eager r3_1b_v2k_compile r4_8b_l8_v2k_compile)"; exit 2 ;;
          esac
        done ;;
      rope) capped rope 90 python3 -m bench.rope_eager 1b 8b; grep -a "eager rope" "$W/rope.log" ;;
      check) capped check 360 python3 -m bench.gpu_perf_check; cat "$W/check.log" | grep -aE "^(PASS|FAIL)|checks passed" ;;
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
      *) echo "unknown stage $st (titan[:CONFIG] float8[:CONFIG] hand[:CONFIG] profile[:CONFIG] ablate[:CONFIG] recompute[:CONFIG] peer peer1[:RUN] peer_budget rope check float8check table)"; exit 2 ;;
    esac
  done
done
finish
