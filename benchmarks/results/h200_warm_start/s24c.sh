#!/usr/bin/env bash
# Session 24: sd-scripts SDXL blocks+auto, the bench's child run directly with every log line time-stamped (where its
# first step goes), fresh caches. usage: bash .gpu/s24c.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export SD_SCRIPTS_DIR=$PWD/.sd-scripts PYTHONPATH=/tmp/site
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
start=$(date +%s.%N)
python3 -m compile_accel.benchmarks.runner --device cuda --compile-workers 8 --steps 5 --warmup 2 --model sdscripts-sdxl --batch 4 \
  --vram-cap-gib 24 --mode blocks+auto ${AUTO_EXTRA:-} > $OUT/sdxl_auto.json \
  2> >(while IFS= read -r l; do printf '%7.2f %s\n' "$(python3 -c "print($(date +%s.%N)-$start)")" "$l"; done > $OUT/sdxl_auto.log)
echo "rc=$?"; sleep 2
tail -1 $OUT/sdxl_auto.json | python3 -c 'import json,sys; r=json.load(sys.stdin); s=r["stats"]; print("first_step_s", round(r["first_step_s"],2), "median", round(r["step_s_median"],4), "auto", {k: s["auto_budget"].get(k) for k in ("budget","calibration_seconds","waited_seconds")} if s.get("auto_budget") else None, "compile_times", s.get("compile_times"))'
