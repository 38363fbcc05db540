#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
A="--model sdscripts-sdxl --batch 4 --vram-cap-gib 24 --device cuda --steps 10 --warmup 3"
run() {  # name, script, extra
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  s=$(date +%s)
  timeout 280 python3 $2 --mode blocks+budget=0.1 $A $3 > $OUT/$1.json 2> $OUT/$1.log
  rc=$?
  echo "$1 rc=$rc $(( $(date +%s) - s )) s $(tail -1 $OUT/$1.json | python3 -c 'import json,sys; r=json.load(sys.stdin); print("median", round(r["step_s_median"],4), "min", round(r["step_s_min"],4), "first", round(r["first_step_s"],1), "peak GiB", round(r["peak_bytes"]/2**30,2), "recompiles", r["stats"]["recompiles"], "fallbacks", len(r["stats"]["fallbacks"]), [round(x,3) for x in r["step_s_each"]])' 2>&1 | tail -1)" | tee -a $OUT/summary.txt
  grep -i "cudagraph\|skipping\|warn" $OUT/$1.log | sort | uniq -c | head -8
}
run ro_workers .gpu/ro.py "--compile-workers 8"
run default_workers "-m compile_accel.benchmarks.runner" "--compile-workers 8"
