"""Experiment (not committed): one bench child with inductor knobs set first. usage: knobs.py KNOBS_JSON runner-args..."""
import json, sys
import torch._inductor.config as c
knobs = json.loads(sys.argv[1])
for name, value in knobs.items():
    obj = c
    *path, last = name.split(".")
    for p in path:
        obj = getattr(obj, p)
    assert hasattr(obj, last), name
    setattr(obj, last, value)
from compile_accel.benchmarks.runner import main
main(sys.argv[2:])
