#!/usr/bin/env bash
# Session 24, call F: warm first steps with and without the inductor preload (compile_accel.preload), alternating, on
# the caches one cold child filled (the bench's child run directly). usage: REPEATS=3 bash .gpu/s24f.sh NAME "args" [...]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/device.txt
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  mkdir -p $R/$name
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
  run() {  # tag, PYTHONPATH, steps, warmup
    PYTHONPATH=$2 python3 -m compile_accel.benchmarks.runner --device cuda --steps $3 --warmup $4 --compile-workers 8 $args > $R/$name/$1.json 2> $R/$name/$1.log
    echo "$name $1 rc=$? $(tail -1 $R/$name/$1.json | python3 -c 'import json,sys; r=json.load(sys.stdin); s=r["stats"]; print("first_step_s", round(r["first_step_s"],2), "median", round(r["step_s_median"],4), "precompiled", s.get("precompiled"), "compile_total_s", (s.get("compile_times") or {}).get("total_s"))' 2>&1 | cut -c1-300) $(grep -h 'precompile: loaded' $R/$name/$1.log | sed 's/.*precompiled in/load/')" | tee -a $R/summary.txt
  }
  run cold /tmp/site 5 2
  for i in $(seq 1 ${REPEATS:-3}); do
    run warm_preload$i /tmp/site 1 0
    run warm_nopreload$i /tmp/site:$PWD/.gpu/nopreload 1 0
  done
  tar -czf $OUT/results.tar.gz -C $R .
done
cp $R/summary.txt $OUT/
