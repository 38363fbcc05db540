#!/usr/bin/env bash
# usage: bash .gpu/workers.sh NAME "bench args" [...]: like run.sh, each bench with fresh inductor/Triton/compile_accel
# caches, and GPU memory per process sampled every second (gpu_procs.txt).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
R=$(mktemp -d); mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/device.txt
python3 -c "import torch, triton, os; print('torch', torch.__version__, 'triton', triton.__version__, 'cpus', os.cpu_count())" >> $R/device.txt
echo "bytecode: site-packages byte-compiled before the runs (compileall), PYTHONDONTWRITEBYTECODE unset" >> $R/device.txt
SAMPLER=
if [ -z "${NO_SAMPLER:-}" ]; then  # NO_SAMPLER=1: no nvidia-smi beside the steps (it may stall launches)
  (while true; do echo "$(date +%s) $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')" >> $R/gpu_procs.txt; sleep 1; done) &
  SAMPLER=$!
fi
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  mkdir -p $R/$name
  echo "compile-accel bench $args --out $name" > $R/$name/command.txt
  start=$(date +%s); echo "$start start $name" >> $R/gpu_procs.txt
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d) \
    compile-accel bench $args --out $R/$name 2>&1 | tee $R/$name/log.txt | tee -a $OUT/run_log.txt
  echo "== $name took $(( $(date +%s) - start )) s" | tee -a $OUT/run_log.txt
  tar -czf $OUT/results.tar.gz -C $R .
done
[ -n "$SAMPLER" ] && kill $SAMPLER
tar -czf $OUT/results.tar.gz -C $R .
