#!/usr/bin/env bash
# Launch a titan training run on this host (torchtitan's run_train.sh contract).
#
#   NGPU          processes on this host (the logical world size under COMM_BACKEND=fake);
#                 default: the number of visible CUDA devices, or 1 without CUDA.
#   LOG_RANK      ranks whose output is shown, passed to torchrun as --local-ranks-filter;
#                 default 0. A comma-separated list shows several ("0,1").
#   MODULE        Python module holding the recipe (none needed for installed plugins' recipes).
#   CONFIG        recipe name; default llama3_debugmodel.
#   COMM_BACKEND  empty (torchrun, real communication) or "fake": one plain process standing
#                 for one rank of an NGPU-rank job, limited to one step unless the recipe sets
#                 debug.max_steps (docs/debugging.md).
# Further arguments go to `python -m titan_core.train` (e.g. --print-config, --dump-folder DIR).
#
#   NGPU=2 ./run_train.sh
#   LOG_RANK=1 NGPU=2 MODULE=my_project.recipes CONFIG=my_recipe ./run_train.sh
#   NGPU=4 FAKE_PP_RANK=1 COMM_BACKEND=fake MODULE=my_debug_configs CONFIG=pp2_fsdp2 ./run_train.sh
set -euo pipefail

visible_cuda_devices() {
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    # An empty CUDA_VISIBLE_DEVICES hides every device.
    [ -z "${CUDA_VISIBLE_DEVICES}" ] && { echo 0; return; }
    echo "${CUDA_VISIBLE_DEVICES}" | tr ',' '\n' | grep -c .
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

if [ -z "${NGPU:-}" ]; then
  NGPU=$(visible_cuda_devices)
  [ "${NGPU}" -gt 0 ] 2>/dev/null || NGPU=1
fi
export NGPU
LOG_RANK=${LOG_RANK:-0}
CONFIG=${CONFIG:-llama3_debugmodel}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}

args=()
if [ -n "${MODULE:-}" ]; then
  args+=(--module "${MODULE}")
fi
args+=(--config "${CONFIG}")

case "${COMM_BACKEND:-}" in
  "" | default)
    exec torchrun \
      --nproc_per_node="${NGPU}" \
      --rdzv_backend c10d \
      --rdzv_endpoint="localhost:0" \
      --local-ranks-filter "${LOG_RANK}" \
      --role rank \
      --tee 3 \
      -m titan_core.train "${args[@]}" "$@"
    ;;
  fake)
    # One process stands for one rank of the NGPU-rank job: no torchrun, no peers.
    export LOCAL_RANK=0
    export TITAN_DEFAULT_MAX_STEPS=1
    exec python -m titan_core.train "${args[@]}" --comm-backend fake "$@"
    ;;
  *)
    echo "run_train.sh: error: COMM_BACKEND=${COMM_BACKEND} is not understood; it accepts only" \
      "'fake' (one process, see docs/debugging.md). Hybrid mode is selected with" \
      "'--comm-backend real_pp_fake_spmd' under torchrun (one process per PP rank), not" \
      "through COMM_BACKEND." >&2
    exit 2
    ;;
esac
