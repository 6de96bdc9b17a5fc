#!/usr/bin/env bash
# Launch a titan training run on this host (torchtitan's run_train.sh contract).
#
#   NGPU          processes on this host (the logical world size under COMM_BACKEND=fake): a
#                 positive integer; default: the number of visible CUDA devices, or 1 without CUDA.
#   LOG_RANK      local ranks whose output is shown, passed to torchrun as --local-ranks-filter;
#                 default 0. A comma-separated list shows several ("0,1"); each must be < NGPU.
#                 Under COMM_BACKEND=fake (one process, local rank 0) it must include 0.
#   MODULE        Python module holding the recipe (none needed for installed plugins' recipes);
#                 with MODULE, CONFIG (or a --config flag) is required.
#   CONFIG        recipe name; default llama3_debugmodel (only without MODULE).
#   COMM_BACKEND  unset (torchrun, real communication) or "fake": one plain process standing
#                 for one rank of an NGPU-rank job (NGPU then required), limited to one step
#                 unless the recipe sets debug.max_steps or TITAN_DEFAULT_MAX_STEPS is set
#                 (docs/debugging.md). An argument --comm-backend fake selects the same mode.
# A variable above set but empty (CONFIG=) is an error, not its default: unset it for the default.
# Further arguments go to `python -m titan_core.train` (e.g. --dump-folder DIR); with --print-config
# (or --help) one plain process prints and exits, without torchrun; --all-pp-ranks (with
# COMM_BACKEND=fake) is one plain process too.
#
# Bad input stops here, before torchrun starts any process: one error line and exit status 2
# (the environment above, the recipe and its config, the parallel degrees against NGPU, what the
# model and the strategies need of the layout, and the launch contract of the comm backend).
# Failures during training exit 1.
#
#   NGPU=2 ./run_train.sh
#   LOG_RANK=1 NGPU=2 MODULE=my_project.recipes CONFIG=my_recipe ./run_train.sh
#   NGPU=4 FAKE_PP_RANK=1 COMM_BACKEND=fake MODULE=my_debug_configs CONFIG=pp2_fsdp2 ./run_train.sh
set -euo pipefail

die() {
  echo "run_train.sh: error: $*" >&2
  exit 2
}

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

# A variable of this contract set but empty (`CONFIG=$RECIPE ./run_train.sh` with RECIPE unset) is
# a mistake, not a request for the default: CONFIG= ran llama3_debugmodel without a word.
empty_fix() {
  case "$1" in
    NGPU) echo "unset it for one process per visible GPU (1 without CUDA), or set the number of processes, e.g. NGPU=2" ;;
    LOG_RANK) echo "unset it to show local rank 0, or name the local ranks to show, e.g. LOG_RANK=0,1" ;;
    MODULE) echo "unset it to look the recipe up among the installed plugins' recipes, or name the Python module holding it" ;;
    CONFIG) echo "unset it to run llama3_debugmodel, or name the recipe to run (titan recipes list)" ;;
    COMM_BACKEND) echo "unset it to launch torchrun with real communication, or set COMM_BACKEND=fake (docs/debugging.md)" ;;
    FAKE_PP_RANK) echo "unset it, or set the pipeline coordinate the fake backend represents (docs/debugging.md)" ;;
  esac
}
for name in NGPU LOG_RANK MODULE CONFIG COMM_BACKEND FAKE_PP_RANK; do
  if [ -n "${!name+x}" ] && [ -z "${!name//[[:space:]]/}" ]; then
    die "${name} is set but empty ('${!name}'): $(empty_fix "${name}")"
  fi
done

# Whether NGPU came from the user: under the fake backend it is the logical world size, which
# the default (the visible devices) cannot know.
ngpu_given=0
[ -n "${NGPU:-}" ] && ngpu_given=1
if [ -z "${NGPU:-}" ]; then
  NGPU=$(visible_cuda_devices)
  [ "${NGPU}" -gt 0 ] 2>/dev/null || NGPU=1
fi
[[ "${NGPU}" =~ ^[1-9][0-9]*$ ]] \
  || die "NGPU='${NGPU}' is not a positive integer: set it to the number of processes to start on" \
    "this host (one per GPU), e.g. NGPU=2"
[ "${#NGPU}" -le 6 ] \
  || die "NGPU=${NGPU} is too large: at most 999999 (processes on this host, or the logical world" \
    "size under COMM_BACKEND=fake)"
export NGPU

# What the extra arguments ask for: --comm-backend (titan refuses two different values), help,
# or only the resolved config (printed by one process: it is the same on every rank).
cli_backend=""
wants_help=0
prints_config=0
all_pp_ranks=0  # --all-pp-ranks: one process that runs the pure fake mode per PP coordinate itself
cli_recipe=0  # the recipe named by --config/--recipe instead of CONFIG
cli_recipes=()  # the values of --config/--recipe
cli_modules=()  # the values of --module
previous=""
for arg in "$@"; do
  case "${previous}" in
    --comm-backend) cli_backend="${arg}" ;;
    --config | --recipe) cli_recipes+=("${arg}") ;;
    --module) cli_modules+=("${arg}") ;;
  esac
  case "${arg}" in
    --comm-backend=*) cli_backend="${arg#*=}" ;;
    -h | --help) wants_help=1 ;;
    --print-config | --print-config=*) prints_config=1 ;;
    --all-pp-ranks) all_pp_ranks=1 ;;
    --config | --recipe) cli_recipe=1 ;;
    --config=* | --recipe=*) cli_recipe=1 cli_recipes+=("${arg#*=}") ;;
    --module=*) cli_modules+=("${arg#*=}") ;;
  esac
  previous="${arg}"
done
# MODULE and --module (CONFIG and --config) both given: titan would take the flag's value, the
# last one, without a word. The same value twice is one choice; two different ones are refused
# (titan itself refuses a flag given twice with two values).
for value in "${cli_modules[@]}"; do
  [ -z "${MODULE:-}" ] || [ "${value}" = "${MODULE}" ] \
    || die "MODULE=${MODULE} and --module ${value} name two different recipe modules; give one of" \
      "them (unset MODULE or drop --module)"
done
for value in "${cli_recipes[@]}"; do
  [ -z "${CONFIG:-}" ] || [ "${value}" = "${CONFIG}" ] \
    || die "CONFIG=${CONFIG} and --config/--recipe ${value} name two different recipes; give one of" \
      "them (unset CONFIG or drop the flag)"
done

backend=${COMM_BACKEND:-}
# `--comm-backend fake` is the pure fake mode too: one plain process for one step, never torchrun
# (which would start NGPU processes that each refuse to run alone).
[ -z "${backend}" ] && [ "${cli_backend}" = fake ] && backend=fake

LOG_RANK=${LOG_RANK:-0}
[[ "${LOG_RANK}" =~ ^(0|[1-9][0-9]*)(,(0|[1-9][0-9]*))*$ ]] \
  || die "LOG_RANK='${LOG_RANK}' is not a comma-separated list of local ranks: use e.g." \
    "LOG_RANK=0 or LOG_RANK=0,1 (each below NGPU=${NGPU})"
IFS=',' read -r -a log_ranks <<<"${LOG_RANK}"
if [ "${backend}" = fake ]; then
  # One process (local rank 0) stands for logical rank FAKE_PP_RANK * NGPU / pp: LOG_RANK
  # neither shows another process nor picks the rank represented.
  [[ ",${LOG_RANK}," == *",0,"* ]] \
    || die "LOG_RANK=${LOG_RANK} does not name local rank 0, but the pure fake mode runs one" \
      "process (local rank 0) for logical rank FAKE_PP_RANK * NGPU / parallelism.pp, whose" \
      "output is always shown: unset LOG_RANK; to represent another pipeline coordinate set" \
      "FAKE_PP_RANK (docs/debugging.md)"
else
  for rank in "${log_ranks[@]}"; do
    [ "${#rank}" -le 6 ] && [ "${rank}" -lt "${NGPU}" ] \
      || die "LOG_RANK=${LOG_RANK} names local rank ${rank}, but NGPU=${NGPU} starts ranks" \
        "0..$((NGPU - 1)); pick ranks below ${NGPU} (output of other ranks is hidden)"
  done
fi

if [ -n "${MODULE:-}" ] && [ -z "${CONFIG:-}" ] && [ "${cli_recipe}" = 0 ]; then
  die "MODULE=${MODULE} is set but CONFIG is not: set CONFIG to the recipe of ${MODULE} to run" \
    "(titan recipes list --module ${MODULE} lists them)"
fi
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
# Log lines in the console format on a terminal: torchrun pipes the workers' output, so they
# cannot see the terminal themselves and would print JSON. A TITAN_LOG_FORMAT already set wins.
if [ -z "${TITAN_LOG_FORMAT:-}" ] && [ -t 1 ]; then
  export TITAN_LOG_FORMAT=console
fi

args=()
if [ -n "${MODULE:-}" ]; then
  args+=(--module "${MODULE}")
fi
# A recipe flag among the arguments names it; CONFIG (or the default) otherwise.
if [ -n "${CONFIG:-}" ] || [ "${cli_recipe}" = 0 ]; then
  args+=(--config "${CONFIG:-llama3_debugmodel}")
fi

# The checks torchrun's workers would make before building anything, in one process first
# (titan_core.run.preflight): the recipe resolves and validates, the comm backend's and plugins'
# launch checks pass for NGPU processes, the parallel degrees fit NGPU, the global batch fits the
# DP degree, the model accepts its arguments and every applied strategy its layout
# (Strategy.check), the dump folder may take the run. A worker's error would otherwise end as
# torchrun's ChildFailedError, or be hidden when LOG_RANK does not show the rank that failed.
launch_check() {
  python -c 'import sys; from titan_core.run import preflight; sys.exit(preflight(sys.argv[2:], int(sys.argv[1])))' \
    "${NGPU}" "${args[@]}" "$@" || exit "$?"
}

case "${backend}" in
  "" | default)
    # --all-pp-ranks is never a torchrun job: one process, which refuses it without the fake
    # backend in one line (NGPU torchrun workers would each refuse it, ending in torchrun's report).
    if [ "${wants_help}" = 1 ] || [ "${prints_config}" = 1 ] || [ "${all_pp_ranks}" = 1 ]; then
      exec python -m titan_core.train "${args[@]}" "$@"
    fi
    launch_check "$@"
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
    if [ -n "${cli_backend}" ] && [ "${cli_backend}" != fake ]; then
      die "COMM_BACKEND=fake and --comm-backend ${cli_backend} ask for two different backends;" \
        "for ${cli_backend} unset COMM_BACKEND (hybrid mode runs under torchrun, docs/debugging.md)"
    fi
    [ "${ngpu_given}" = 1 ] || [ "${wants_help}" = 1 ] || [ "${prints_config}" = 1 ] \
      || die "the fake comm backend needs NGPU, the logical world size of the job this process" \
        "stands for (the product of the recipe's parallel degrees), e.g. NGPU=8; the launcher's" \
        "default NGPU=${NGPU} (the visible CUDA devices, or 1) says nothing of the recipe's job"
    # One process stands for one rank of the NGPU-rank job: no torchrun, no peers. The process
    # checks its launch contract itself before building anything (exit 2 on an error).
    export LOCAL_RANK=0
    # One step unless the recipe (debug.max_steps) or the user's TITAN_DEFAULT_MAX_STEPS say more.
    export TITAN_DEFAULT_MAX_STEPS=${TITAN_DEFAULT_MAX_STEPS:-1}
    exec python -m titan_core.train "${args[@]}" --comm-backend fake "$@"
    ;;
  *)
    die "COMM_BACKEND=${COMM_BACKEND} is not understood; it accepts only" \
      "'fake' (one process, see docs/debugging.md). Hybrid mode is selected with" \
      "'--comm-backend real_pp_fake_spmd' under torchrun (one process per PP rank), not" \
      "through COMM_BACKEND."
    ;;
esac
