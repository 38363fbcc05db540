#!/usr/bin/env bash
# Inductor knobs against Flux fp8 selective's cold first step (each: a fresh inductor cache), then baseline warm.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts PYTHONUNBUFFERED=1
ARGS="--mode selective+ckpt --device cuda --model sdscripts-flux --fp8-base --vram-cap-gib 24 --steps 3 --warmup 1"
run() { # name cache knobs
  start=$(date +%s)
  TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$2 COMPILE_ACCEL_CACHE_DIR=/tmp/ca_$1 python3 .gpu/knobs.py "$3" $ARGS > $OUT/$1.out 2> $OUT/$1.err
  python3 - "$1" <<'PY'
import json, sys, os
name = sys.argv[1]
r = json.loads(open(os.environ["OUT"] + f"/{name}.out").read().strip().splitlines()[-1])
t = r["stats"]["compile_times"]
print(f"{name}: first {r['first_step_s']:.1f} s, step {r['step_s_median']:.4f} s, " + ", ".join(f"{k} {v}" for k, v in t.items() if k.endswith('_s')))
PY
  echo "   ($(( $(date +%s) - start )) s)"
}
run base base '{}'
run base_warm base '{}'
run nopattern nopattern '{"pattern_matcher": false}'
run noloopreorder noloopreorder '{"loop_ordering_after_fusion": false}'
run noautotune_pw noautotune_pw '{"triton.autotune_pointwise": false}'
python3 - <<'PY'
import json, os
for name in ("base", "base_warm"):
    r = json.loads(open(os.environ["OUT"] + f"/{name}.out").read().strip().splitlines()[-1])
    timers = r["stats"]["torch_compile_timers_s"]
    print("==", name)
    for k, v in sorted(timers.items(), key=lambda kv: -kv[1])[:40]:
        print(f"{v:8.3f} {k}")
PY
