#!/usr/bin/env bash
# usage: bash .gpu/prof.sh "runner args": a cold child fills fresh caches, then a warm child under cProfile; pstats as text.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
python3 -m compile_accel.benchmarks.runner --device cuda --steps 1 --warmup 0 $1 > $OUT/cold.json 2> $OUT/cold.log; echo cold rc=$?
python3 -m compile_accel.benchmarks.runner --device cuda --steps 1 --warmup 0 $1 > $OUT/warm.json 2> $OUT/warm.log; echo warm rc=$?
python3 -m cProfile -o /tmp/warm.prof -m compile_accel.benchmarks.runner --device cuda --steps 1 --warmup 0 $1 > $OUT/prof.json 2> $OUT/prof.log; echo prof rc=$?
python3 - <<'PY' > $OUT/prof.txt
import pstats
p = pstats.Stats("/tmp/warm.prof")
p.sort_stats("cumulative").print_stats(150)
p.sort_stats("tottime").print_stats(60)
PY
tail -1 $OUT/warm.json | cut -c1-300; tail -1 $OUT/prof.json | cut -c1-300
