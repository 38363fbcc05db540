#!/usr/bin/env bash
# usage: bash .gpu/knobs.sh NAME 'SETTINGS_JSON' "runner args" ... ; each cold (fresh caches) then warm; summary in $OUT/knobs.txt
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=/tmp/site SD_SCRIPTS_DIR=$PWD/.sd-scripts
python3 -m compileall -q -j 16 $(python3 -c "import site; print(site.getsitepackages()[0])") /tmp/site >/dev/null 2>&1; unset PYTHONDONTWRITEBYTECODE
K=/tmp/k; mkdir -p $K
while [ $# -ge 3 ]; do
  name=$1; knobs=$2; args=$3; shift 3
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) COMPILE_ACCEL_CACHE_DIR=$(mktemp -d)
  for start in cold warm; do
    extra=""; [ $start = warm ] && extra="--steps 1 --warmup 0"
    python3 .gpu/knobs.py "$knobs" $args $extra > $K/${name}_$start.out 2> $K/${name}_$start.err
    python3 - "$name" "$start" "$K/${name}_$start.out" <<'PY' | tee -a $OUT/knobs.txt
import json, sys
name, start, path = sys.argv[1:]
try:
    r = json.loads(open(path).read().strip().splitlines()[-1])
except Exception as e:
    print(name, start, "FAILED", e); sys.exit()
ct = r["stats"]["compile_times"]
print(f"{name:28s} {start}: first {r['first_step_s']:6.1f} s  step {r['step_s_median']:.4f}  graphs {r['stats']['unique_graphs']} recompiles {r['stats']['recompiles']}  " + " ".join(f"{k[:-2]} {v}" for k, v in ct.items() if k.endswith('_s')) + f" fx {ct['fx_graphs_compiled']}/{ct['fx_graphs_from_cache']} aot {ct['aot_graphs_from_cache']}")
PY
  done
  tar -czf $OUT/k.tar.gz -C /tmp k
done
