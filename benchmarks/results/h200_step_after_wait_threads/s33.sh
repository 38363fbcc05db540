#!/usr/bin/env bash
# Session 33: s30.sh plus an nvidia-smi clock/utilisation log (100 ms) per bench.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$(mktemp -d); mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,persistence_mode --format=csv > $R/device.txt
python3 -c "import torch, triton, os; print('torch', torch.__version__, 'triton', triton.__version__, 'cpus', os.cpu_count())" >> $R/device.txt
git log -1 --format=%H >> $R/device.txt; git status --short >> $R/device.txt
for spec in "$@"; do
  IFS='|' read -r name envs args <<< "$spec"
  mkdir -p $R/$name
  echo "$envs compile-accel bench $args --out $name" > $R/$name/command.txt
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw,pstate --format=csv,nounits -lms 100 > $R/$name/smi.csv 2>&1 &
  smi=$!
  start=$(date +%s)
  env $envs CA_EXP_DIR=$R/$name TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d) \
    compile-accel bench $args --out $R/$name > $R/$name/log.txt 2>&1
  echo "== $name rc $? took $(( $(date +%s) - start )) s" | tee -a $R/run_log.txt $OUT/run_log.txt
  kill $smi
  tar -czf $OUT/results.tar.gz -C $R .
  python3 -c "
import json,sys
r=json.load(open('$R/$name/bench.json'))['results']
for m in r: print(m['mode'], m['first_step_s'], [round(t,3) for t in m['step_s_each']], m['stats'].get('exp',{}).get('gpu_warm_matmuls'))
"
done
