#!/usr/bin/env bash
# Session 22, call 7: auto predicting by bisection (SDXL, Lumina 2), SD3 with CUDA graphs beside eager.
set -uo pipefail
bash .gpu/workers.sh \
  sdxl_auto_bisect "--model sdscripts-sdxl --device cuda --batch 4 --vram-cap-gib 24 --modes blocks+auto --steps 5 --warmup 2 --compile-workers 8" \
  lumina_auto_bisect "--model lumina2 --device cuda --modes blocks+auto --vram-limit-gib 10.8 --steps 5 --warmup 2 --compile-workers 8" \
  sd3_cudagraphs "--model sdscripts-sd3 --device cuda --vram-cap-gib 24 --modes eager+ckpt,blocks+budget=0.1,blocks+budget=0.1+cudagraphs --steps 10 --warmup 3 --compile-workers 8"
