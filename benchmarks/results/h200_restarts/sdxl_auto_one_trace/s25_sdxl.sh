#!/usr/bin/env bash
# Session 25, last call: sd-scripts SDXL blocks+auto, one bench child (1 step), cold caches, as workers.sh sets up.
# The child's log is time-stamped and written to $OUT as it runs (a cut call still returns it).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
echo "$(date +%s) start" > $OUT/log.txt
timeout 170 python3 -m compile_accel.benchmarks.runner --mode blocks+auto --model sdscripts-sdxl --device cuda --steps 1 --warmup 0 --lora-rank 16 --batch 4 --vram-cap-gib 24 --compile-workers 8 2>&1 \
  | while IFS= read -r line; do echo "$(date +%s.%N | cut -c1-14) $line"; done | tee -a $OUT/log.txt | grep -v "^[0-9.]* compile_accel: compiled " | tail -5
echo "$(date +%s) end" >> $OUT/log.txt
