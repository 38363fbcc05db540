#!/usr/bin/env bash
# Session 23, call A: CUDA-graph GPU tests (selective under reentrant / non-reentrant checkpointing), then
# sd-scripts SDXL selective with and without CUDA graphs beside eager.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
mkdir -p $OUT
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 330 python3 -m pytest -x -q -m gpu tests/test_gpu.py -k cuda_graphs -p no:cacheprovider 2>&1 | tail -40 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
bash .gpu/workers.sh sdxl_sel_cg "--model sdscripts-sdxl --device cuda --batch 4 --vram-cap-gib 24 --modes eager+ckpt,selective+ckpt,selective+ckpt+cudagraphs --steps 10 --warmup 3 --compile-workers 8"
