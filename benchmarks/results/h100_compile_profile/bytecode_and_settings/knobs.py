"""Experiment (not committed): one bench child with settings applied first.
usage: knobs.py SETTINGS_JSON runner-args...   SETTINGS: inductor config names -> values, plus "dynamic" (CompileConfig.dynamic)"""
import json, sys
import torch._inductor.config as c
knobs = json.loads(sys.argv[1])
dynamic = knobs.pop("dynamic", "unset")
for name, value in knobs.items():
    obj = c
    *path, last = name.split(".")
    for p in path:
        obj = getattr(obj, p)
    assert hasattr(obj, last), name
    setattr(obj, last, value)
from compile_accel.benchmarks import runner
if dynamic != "unset":
    parse = runner.parse_mode
    def parse_mode(spec):
        mode = parse(spec)
        mode.config.dynamic = dynamic
        return mode
    runner.parse_mode = parse_mode
runner.main(sys.argv[2:])
