#!/usr/bin/env bash
# Session 22, call 5: the CUDA-graph GPU tests (auto among them), then SDXL auto with CUDA graphs beside eager.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
( export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
  timeout 240 python3 -m pytest -q -p no:logging tests/test_gpu.py -k "cuda_graphs" -rA 2>&1 | grep -v "^DEBUG\|^INFO" | tail -30 > $OUT/gpu_tests.txt; echo "pytest rc=${PIPESTATUS[0]}" >> $OUT/gpu_tests.txt )
tail -6 $OUT/gpu_tests.txt
bash .gpu/workers.sh \
  sdxl_auto_cudagraphs "--model sdscripts-sdxl --device cuda --batch 4 --vram-cap-gib 24 --modes eager+ckpt,blocks+auto+cudagraphs --steps 10 --warmup 3 --compile-workers 8"
