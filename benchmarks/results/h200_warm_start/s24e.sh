#!/usr/bin/env bash
# Session 24, call E: the Flux fp8 bench with --compile-profile (workers.sh), then Lumina 2 budget 0.5: a cold child and
# a warm child whose precompiled load runs under cProfile (loadprof.py).
bash .gpu/workers.sh flux "--model sdscripts-flux --device cuda --fp8-base --vram-cap-gib 24 --modes eager+ckpt,selective+ckpt,blocks+budget=0.1 --steps 10 --warmup 3 --compile-workers 8 --compile-profile"
export SD_SCRIPTS_DIR=$PWD/.sd-scripts PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
ARGS="--device cuda --compile-workers 8 --model sdscripts-lumina2 --batch 2 --vram-cap-gib 24 --mode blocks+budget=0.5"
python3 -m compile_accel.benchmarks.runner --steps 2 --warmup 1 $ARGS > $OUT/lumina_cold.json 2> $OUT/lumina_cold.log
for i in 1 2; do
  LOADPROF=$OUT/lumina_load_profile$i.txt python3 .gpu/loadprof.py --steps 1 --warmup 0 $ARGS > $OUT/lumina_warm$i.json 2> $OUT/lumina_warm$i.log
  tail -1 $OUT/lumina_warm$i.json | python3 -c 'import json,sys; r=json.load(sys.stdin); print("lumina warm (load profiled)", round(r["first_step_s"],2), r["stats"]["precompiled"])'
done
