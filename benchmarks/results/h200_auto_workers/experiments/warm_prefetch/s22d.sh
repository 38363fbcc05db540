#!/usr/bin/env bash
# Session 22, call 4: warm first step with and without the cache-key prefetch (Flux fp8 budget 0.1,
# Lumina 2 budget 0.5): one cold child fills fresh caches, then warm children alternate A/B, 3 each.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$OUT
for spec in "flux|--model sdscripts-flux --fp8-base --vram-cap-gib 24 --mode blocks+budget=0.1" "lumina|--model lumina2 --batch 2 --vram-cap-gib 24 --mode blocks+budget=0.5"; do
  name=${spec%%|*}; args=${spec#*|}
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  run() {  # tag, program
    tag=$1; shift
    python3 "$@" --device cuda --steps 1 --warmup 0 $args --compile-workers 8 > $R/${name}_$tag.json 2> /tmp/${name}_$tag.log
    echo "$name $tag rc=$? $(tail -1 $R/${name}_$tag.json | python3 -c 'import json,sys; r=json.load(sys.stdin); c=r["stats"]["compile_times"]; print("first_step_s", round(r["first_step_s"],3), {k: c[k] for k in ("dynamo_s","aot_s","kernels_s","autotune_s","total_s","warm")})' 2>&1 | cut -c1-300)" | tee -a $R/summary.txt
  }
  run cold -m compile_accel.benchmarks.runner
  for i in 1 2 3; do
    run prefetch$i -m compile_accel.benchmarks.runner
    run noprefetch$i .gpu/noprefetch.py
  done
done
cd $R && tar -czf warm_ab.tar.gz *.json && rm -f *.json
