#!/usr/bin/env bash
# Session 23, call C: warm first steps with and without precompiled graphs, alternating, on the caches one cold child
# filled (the bench's child run directly). usage: bash .gpu/s23c.sh NAME "runner args" [...]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/device.txt
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  mkdir -p $R/$name
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
  run() {  # tag, PYTHONPATH, steps, warmup
    s=$(date +%s.%N)
    PYTHONPATH=$2 python3 -m compile_accel.benchmarks.runner --device cuda --steps $3 --warmup $4 --compile-workers 8 $args > $R/$name/$1.json 2> $R/$name/$1.log
    echo "$name $1 rc=$? wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))") $(tail -1 $R/$name/$1.json | python3 -c 'import json,sys; r=json.load(sys.stdin); s=r["stats"]; print("first_step_s", round(r["first_step_s"],2), "precompiled", s.get("precompiled"), "compile_times", s.get("compile_times"))' 2>&1 | cut -c1-500)" | tee -a $R/summary.txt
  }
  run cold /tmp/site 2 1
  for i in $(seq 1 ${REPEATS:-3}); do
    run warm_pre$i /tmp/site 1 0
    run warm_nopre$i /tmp/site:$PWD/.gpu/noprecompile 1 0
  done
  grep -h "precompile" $R/$name/*.log | cut -c1-300 >> $R/summary.txt
  tar -czf $OUT/results.tar.gz -C $R .
done
cp $R/summary.txt $OUT/
