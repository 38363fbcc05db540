#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
for mode in "$@"; do
  python3 .gpu/steady_prof.py --mode $mode --model sdscripts-sdxl --batch 4 --vram-cap-gib 24 --device cuda --steps 5 --warmup 3 --profile-steps 3 --compile-workers 8 > "$OUT/${mode//[+=.]/_}.json" 2> "$OUT/${mode//[+=.]/_}.log"
  echo "$mode rc=$?"
done
