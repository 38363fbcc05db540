#!/usr/bin/env bash
# Session 22, call 6: after the review fixes: the CUDA-graph GPU tests (auto among them) and Lumina 2 auto with workers.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
( export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
  timeout 240 python3 -m pytest -q -p no:logging tests/test_gpu.py -k "cuda_graphs" -rA 2>&1 | grep -v "^DEBUG\|^INFO" | tail -12 > $OUT/gpu_tests.txt; echo "pytest rc=${PIPESTATUS[0]}" >> $OUT/gpu_tests.txt )
tail -6 $OUT/gpu_tests.txt
bash .gpu/workers.sh \
  lumina_auto "--model lumina2 --device cuda --modes blocks+auto --vram-limit-gib 10.8 --steps 5 --warmup 2 --compile-workers 8"
