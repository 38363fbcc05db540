#!/usr/bin/env bash
# Session 24, call A: (1) sd-scripts SDXL eager+ckpt and selective+ckpt, 20 steps, with every garbage collection and
# synchronize logged (gclog/sitecustomize.py); (2) Lumina 2 budget 0.5: cold child, two warm children, one warm child
# under cProfile (where a warm start with precompiled graphs spends its first step).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$OUT; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/device.txt
python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])" >> $R/device.txt
mkdir -p /tmp/r/sdxl /tmp/r/lumina; export GC_LOG=/tmp/r/sdxl
summary() { tail -1 $1 | python3 -c 'import json,sys; r=json.load(sys.stdin); s=r["stats"]; print("first_step_s", round(r["first_step_s"],2), "median", r.get("step_s_median"), "precompiled", s.get("precompiled"), "warm_pre", r.get("warm_precompiled"), "compile_times", s.get("compile_times"))' 2>&1 | cut -c1-600; }
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
for mode in eager+ckpt selective+ckpt; do
  PYTHONPATH=/tmp/site:$PWD/.gpu/gclog python3 -m compile_accel.benchmarks.runner --device cuda --steps 20 --warmup 3 --compile-workers 8 \
    --model sdscripts-sdxl --batch 4 --vram-cap-gib 24 --mode $mode > /tmp/r/sdxl/$mode.json 2> /tmp/r/sdxl/$mode.log
  echo "sdxl $mode rc=$? $(summary /tmp/r/sdxl/$mode.json)" | tee -a $R/summary.txt
done
unset GC_LOG
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
ARGS="--device cuda --compile-workers 8 --model sdscripts-lumina2 --batch 2 --vram-cap-gib 24 --mode blocks+budget=0.5"
export PYTHONPATH=/tmp/site
for tag in cold warm1 warm2; do
  steps="1 0"; [ $tag = cold ] && steps="2 1"; set -- $steps
  s=$(date +%s.%N); python3 -m compile_accel.benchmarks.runner --steps $1 --warmup $2 $ARGS > /tmp/r/lumina/$tag.json 2> /tmp/r/lumina/$tag.log
  echo "lumina $tag rc=$? wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))") $(summary /tmp/r/lumina/$tag.json)" | tee -a $R/summary.txt
  [ $tag = cold ] && sleep 20  # the precompiled graphs written
done
python3 -m cProfile -o /tmp/r/lumina/warm.prof -m compile_accel.benchmarks.runner --steps 1 --warmup 0 $ARGS > /tmp/r/lumina/warm_prof.json 2> /tmp/r/lumina/warm_prof.log
echo "lumina warm_prof rc=$? $(summary /tmp/r/lumina/warm_prof.json)" | tee -a $R/summary.txt
python3 - > /tmp/r/lumina/profile.txt <<'PY'
import pstats
s = pstats.Stats("/tmp/r/lumina/warm.prof")
s.sort_stats("tottime").print_stats(50)
s.sort_stats("cumulative").print_stats(120)
PY
grep -h "precompile\|first step\|compile cache\|loaded" /tmp/r/lumina/*.log | cut -c1-300 >> $R/summary.txt
rm -f /tmp/r/lumina/warm.prof
tar -czf $R/results.tar.gz -C /tmp/r .
