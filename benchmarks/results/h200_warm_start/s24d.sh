#!/usr/bin/env bash
# Session 24, call D: SDXL budget 0.1's GPU kernel time per step with inductor's dynamic_scale_rblock on and off
# (s24b.sh, 3 profiled steps), then SDXL blocks+auto with a time-stamped log (s24c.sh).
WARM=0 bash .gpu/s24b.sh sdxl_b01_prof "--steps 8 --warmup 3 --profile-steps 3 --model sdscripts-sdxl --batch 4 --vram-cap-gib 24 --mode blocks+budget=0.1"
cp $OUT/summary.txt $OUT/summary_b.txt
bash .gpu/s24c.sh
