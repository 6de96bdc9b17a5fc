#!/usr/bin/env bash
# Install titan and its plugins on the GPU machine (no network there): carried wheels from .whl
# (cattrs, structlog, setuptools; build them with the commands in bench/README.md), then every
# distribution of this checkout with --no-deps. Source it: `source bench/setup_device.sh`.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TITAN_LOG_FORMAT=json
SITE=/tmp/site
export PYTHONPATH=$SITE
# A later call on the warm machine (bench/perf.sh with PERF_SKIP_DONE=1) skips installing the same
# sources and wheels again: some 25 s, which left a lease's last call too little time for a run.
stamp=$(find . \( -path ./.git -o -path ./.peer -o -path ./.head -o -name build -o -name '*.egg-info' \
  -o -name __pycache__ \) -prune -o -type f -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum)
if [ "$(cat "$SITE/.titan-sources" 2>/dev/null)" = "$stamp" ]; then
  echo "titan: these sources are installed in $SITE already"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/cattrs-*.whl .whl/structlog-*.whl .whl/setuptools-*.whl || return 1
  dists=(./ ./titan_plugins_llama3)
  for d in ./titan_plugins_moe ./plugins/*/; do [ -f "$d/pyproject.toml" ] && dists+=("$d"); done
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" \
    "${dists[@]}" || return 1
  echo "$stamp" > "$SITE/.titan-sources"
fi
python3 -c "import torch, titan_core; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name())"
python3 -m titan_core.cli plugins list
