#!/usr/bin/env bash
# Session 24, call B: inductor's dynamic_scale_rblock on (torch's default) against off (TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0),
# fresh caches per setting: a cold child of the bench (steps, warm-up as given) and WARM warm children of one step.
# usage: WARM=2 bash .gpu/s24b.sh NAME "runner args" [...]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export SD_SCRIPTS_DIR=$PWD/.sd-scripts PYTHONPATH=/tmp/site
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=/tmp/r; mkdir -p $R; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/device.txt
summary() { tail -1 $1 | python3 -c 'import json,sys; r=json.load(sys.stdin); s=r["stats"]; c=s.get("compile_times") or {}; print("first_step_s", round(r["first_step_s"],2), "median", round(r["step_s_median"],4), "steps", [round(x,3) for x in r["step_s_each"]], "recompiles", s.get("recompiles"), "fallbacks", len(s.get("fallbacks", [])), "precompiled", s.get("precompiled"), "autotune_s", c.get("autotune_s"), "kernels_s", c.get("kernels_s"), "total_s", c.get("total_s"), "gpu_s", {k: round(v*1e3,1) for k, v in (s.get("gpu_time_per_step_s") or {}).items()})' 2>&1 | cut -c1-900; }
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  for knob in 1 0; do
    d=$R/$name/scale$knob; mkdir -p $d
    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=$knob
    TAGS="cold"; for i in $(seq 1 ${WARM:-2}); do TAGS="$TAGS warm$i"; done
    for tag in $TAGS; do
      extra=""; [ $tag != cold ] && extra="--steps 1 --warmup 0"
      python3 -m compile_accel.benchmarks.runner --device cuda --compile-workers 8 $args $extra > $d/$tag.json 2> $d/$tag.log
      echo "$name scale_rblock=$knob $tag rc=$? $(summary $d/$tag.json)" | tee -a $OUT/summary.txt
    done
  done
  tar -czf $OUT/results.tar.gz -C $R .
done
