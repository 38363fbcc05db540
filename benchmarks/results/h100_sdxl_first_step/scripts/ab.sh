#!/usr/bin/env bash
# usage: bash .gpu/ab.sh NAME "bench args" ENV=VALUE ... ; like run.sh, one bench, extra env, shared inductor cache
set -uo pipefail
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPATH=$PWD/benchmarks/results/h100_sdxl_first_step/scripts:/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
mkdir -p /tmp/res
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/res/device.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> /tmp/res/device.txt
while [ $# -ge 2 ]; do
  name=$1; args=$2; envs=$3; shift 3
  mkdir -p /tmp/res/$name
  echo "$envs compile-accel bench $args --out $name" > /tmp/res/$name/command.txt
  start=$(date +%s)
  env $envs compile-accel bench $args --out /tmp/res/$name 2>&1 | tee /tmp/res/$name/log.txt | tee -a $OUT/run_log.txt
  echo "== $name took $(( $(date +%s) - start )) s"
  tar -czf $OUT/results.tar.gz -C /tmp/res .
done
