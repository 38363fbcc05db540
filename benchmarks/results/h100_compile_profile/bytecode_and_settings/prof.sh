#!/usr/bin/env bash
# usage: bash .gpu/prof.sh NAME "runner args" ... ; each NAME cold (fresh inductor cache), then NAME_warm; all tarred into $OUT/prof.tar.gz
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
if [ "${BYTECODE:-0}" = 1 ]; then
  # as pip does at install: the device's torch has no __pycache__ and PYTHONDONTWRITEBYTECODE=1
  start=$(date +%s); python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1
  echo "== bytecode compiled in $(( $(date +%s) - start )) s"; unset PYTHONDONTWRITEBYTECODE
fi
R=/tmp/prof; mkdir -p $R; ORIG_OUT=$OUT; export OUT=$R
python3 - <<'PY' > $R/env.txt 2>&1
import torch, os, sys, glob
d = os.path.dirname(torch.__file__)
print(torch.__version__, d, "writable", os.access(d + "/_dynamo", os.W_OK))
print("pycache in _dynamo:", len(glob.glob(d + "/_dynamo/__pycache__/*.pyc")), "py:", len(glob.glob(d + "/_dynamo/*.py")))
print("pycache in _inductor:", len(glob.glob(d + "/_inductor/__pycache__/*.pyc")), "py:", len(glob.glob(d + "/_inductor/*.py")))
print(sys.flags.dont_write_bytecode, os.environ.get("PYTHONDONTWRITEBYTECODE"), sys.pycache_prefix)
PY
cat $R/env.txt
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
  start=$(date +%s)
  python3 .gpu/prof.py $name $args 2> $R/$name.log | tail -1
  echo "== $name took $(( $(date +%s) - start )) s"
  start=$(date +%s)
  python3 .gpu/prof.py ${name}_warm $args --steps 1 --warmup 0 2> $R/${name}_warm.log | tail -1
  echo "== ${name}_warm took $(( $(date +%s) - start )) s"
  tar -czf $ORIG_OUT/prof.tar.gz -C $R .
done
