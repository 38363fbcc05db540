#!/usr/bin/env bash
# Session 29: where a graph's time goes in a compile worker; kernel pool warm-up / threads variants.
# usage: bash .gpu/s29a.sh "NAME|ENV=.. ENV=..|bench args" ...
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$(mktemp -d); mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/device.txt
python3 -c "import torch, triton, os; print('torch', torch.__version__, 'triton', triton.__version__, 'cpus', os.cpu_count())" >> $R/device.txt
git log -1 --format=%H >> $R/device.txt; git status --short >> $R/device.txt
for spec in "$@"; do
  IFS='|' read -r name envs args <<< "$spec"
  mkdir -p $R/$name
  echo "$envs compile-accel bench $args --out $name" > $R/$name/command.txt
  start=$(date +%s)
  env $envs TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d) \
    compile-accel bench $args --out $R/$name > $R/$name/log.txt 2>&1
  echo "== $name rc $? took $(( $(date +%s) - start )) s" | tee -a $R/run_log.txt $OUT/run_log.txt
  tar -czf $OUT/results.tar.gz -C $R .
  grep -h "CA_EXP\|compiled in a worker\|first step\|^|" $R/$name/log.txt $R/$name/*.md 2>/dev/null | tail -40
done
