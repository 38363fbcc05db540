#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
mkdir -p $OUT/diag
( export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  A="--mode blocks+budget=0.1 --model sdscripts-flux --fp8-base --vram-cap-gib 24 --device cuda --steps 1 --warmup 0 --compile-workers 8"
  for t in cold warm warm2; do python3 .gpu/autotune_diag.py $A > $OUT/diag/$t.json 2> $OUT/diag/$t.log; echo "diag $t rc=$?"; done
  find $TORCHINDUCTOR_CACHE_DIR -name "*.best_config" -printf "%T@ %p\n" > $OUT/diag/best_config_files.txt )
tar -czf $OUT/diag.tar.gz -C $OUT diag && rm -rf $OUT/diag
shift 0
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d) \
    compile-accel bench $args --out $OUT/b/$name 2>&1 | tail -20
  tar -czf $OUT/bench.tar.gz -C $OUT/b .
done
rm -rf $OUT/b
