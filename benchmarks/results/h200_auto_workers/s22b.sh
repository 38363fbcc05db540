#!/usr/bin/env bash
# Session 22, call 2: auto with compile workers (first step waits for the prediction only).
set -uo pipefail
bash .gpu/workers.sh \
  lumina_auto "--model lumina2 --device cuda --modes blocks+auto --vram-limit-gib 10.8 --steps 5 --warmup 2 --compile-workers 8" \
  flux_auto "--model sdscripts-flux --device cuda --fp8-base --vram-cap-gib 24 --modes eager+ckpt,blocks+auto --steps 5 --warmup 2 --compile-workers 8"
