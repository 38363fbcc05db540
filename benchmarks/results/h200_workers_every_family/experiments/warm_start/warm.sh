#!/usr/bin/env bash
# usage: bash .gpu/warm.sh NAME "runner args" [...]: per NAME one cold child fills fresh caches, then warm children
# (workers 8; workers 0; each with the main process's inductor kernel pool at 1 thread), one warm child under cProfile.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$OUT
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  mkdir -p $R/$name
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  run() {  # tag, extra env/args...
    tag=$1; shift
    s=$(date +%s.%N)
    env "$@" python3 -m compile_accel.benchmarks.runner --device cuda --steps 1 --warmup 0 $args $EXTRA > $R/$name/$tag.json 2> $R/$name/$tag.log
    echo "$name $tag rc=$? wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))") $(tail -1 $R/$name/$tag.json | python3 -c 'import json,sys; r=json.load(sys.stdin); print("first_step_s", round(r["first_step_s"],2), "compile_times", r["stats"].get("compile_times"))' 2>&1 | cut -c1-400)" | tee -a $R/summary.txt
  }
  EXTRA="--compile-workers 8"; run cold X=1
  EXTRA="--compile-workers 8"; run warm_w8 X=1
  EXTRA=""; run warm_w0 X=1
  EXTRA="--compile-workers 8"; run warm_w8_threads1 TORCHINDUCTOR_COMPILE_THREADS=1
  EXTRA=""; run warm_w0_threads1 TORCHINDUCTOR_COMPILE_THREADS=1
  s=$(date +%s)
  python3 -m cProfile -o $R/$name/warm_w8.prof -m compile_accel.benchmarks.runner --device cuda --steps 1 --warmup 0 $args --compile-workers 8 > $R/$name/prof.json 2> $R/$name/prof.log
  echo "$name prof rc=$? $(( $(date +%s) - s )) s" | tee -a $R/summary.txt
done
