#!/usr/bin/env bash
# Session 27: selective CUDA graphs (graphs without grad recorded, outputs copied out): the GPU tests, then SDXL
# eager / selective / selective+cudagraphs in one bench (no nvidia-smi sampler).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
mkdir -p $OUT
PYTHONPATH=/tmp/site timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k "cuda_graphs" 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
NO_SAMPLER=1 bash .gpu/workers.sh "$@"
