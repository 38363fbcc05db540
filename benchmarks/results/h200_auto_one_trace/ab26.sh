#!/usr/bin/env bash
# Session 26: A/B of auto's first step, sd-scripts SDXL blocks+auto, one bench child (1 step) per code version,
# cold caches; time-stamped logs in $OUT/<name>.log. usage: bash .gpu/ab26.sh NAME DIR [NAME DIR ...]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
ROOT=$PWD
while [ $# -ge 2 ]; do
  name=$1; dir=$2; shift 2
  (cd $dir && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null) || exit 1
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
  echo "$(date +%s) start $dir" > $OUT/$name.log
  (cd $ROOT && timeout ${CHILD_TIMEOUT:-150} python3 -m compile_accel.benchmarks.runner --mode blocks+auto --model sdscripts-sdxl --device cuda --steps 1 --warmup 0 --lora-rank 16 --batch 4 --vram-cap-gib 24 --compile-workers 8 2>&1) \
    | while IFS= read -r line; do echo "$(date +%s.%N | cut -c1-14) $line"; done | grep -v "compile cache: saved" >> $OUT/$name.log
  echo "$(date +%s) end" >> $OUT/$name.log
  grep -h "first_step\|step_s\|auto:" $OUT/$name.log | cut -c1-200 | tail -4
done
