#!/usr/bin/env bash
# Session 22, call 3: SDXL auto with compile workers, and budget 0.5 with CUDA graphs, beside eager.
set -uo pipefail
bash .gpu/workers.sh \
  sdxl_auto "--model sdscripts-sdxl --device cuda --batch 4 --vram-cap-gib 24 --modes eager+ckpt,blocks+auto,blocks+budget=0.5+cudagraphs --steps 10 --warmup 3 --compile-workers 8"
