#!/usr/bin/env bash
# Session 23, call D: where a warm start with precompiled graphs spends its first step (cProfile of the warm child).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
ARGS="--device cuda --compile-workers 8 --model sdscripts-flux --fp8-base --vram-cap-gib 24 --mode blocks+budget=0.1"
python3 -m compile_accel.benchmarks.runner --steps 2 --warmup 1 $ARGS > $OUT/cold.json 2> $OUT/cold.log
python3 -m compile_accel.benchmarks.runner --steps 1 --warmup 0 $ARGS > $OUT/warm1.json 2> $OUT/warm1.log
python3 -m cProfile -o /tmp/warm.prof -m compile_accel.benchmarks.runner --steps 1 --warmup 0 $ARGS > $OUT/warm_prof.json 2> $OUT/warm_prof.log
python3 - > $OUT/profile.txt <<'PY'
import pstats
s = pstats.Stats("/tmp/warm.prof"); s.sort_stats("cumulative")
s.print_callees("load_precompiled")
s.print_callees("deserialize_compile_artifacts")
s.print_stats("precompile|aot_compile|aot_autograd_result|codecache|triton_heuristics|static_cuda|compile_fx|output_code", 60)
PY
grep -h "precompile\|first step\|compile cache" $OUT/*.log | cut -c1-300
for f in cold warm1 warm_prof; do tail -1 $OUT/$f.json | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["first_step_s"], r["stats"]["precompiled"], r["stats"]["compile_times"]["total_s"])'; done
