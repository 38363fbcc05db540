#!/usr/bin/env bash
# Session 22, call 1: SDXL budget 0.1 with and without CUDA graphs beside its eager row; the CUDA-graph GPU tests.
set -uo pipefail
bash .gpu/workers.sh sdxl_cudagraphs "--model sdscripts-sdxl --device cuda --batch 4 --vram-cap-gib 24 --modes eager+ckpt,blocks+budget=0.1,blocks+budget=0.1+cudagraphs --steps 20 --warmup 3 --compile-workers 8"
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
timeout 200 python3 -m pytest -q -x tests/test_gpu.py -k "cuda_graphs" -rA > $OUT/gpu_tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu_tests.txt
tail -5 $OUT/gpu_tests.txt
