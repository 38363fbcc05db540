# Session 24: the bench's child with compile_accel.precompile.load_precompiled under cProfile (stats to $LOADPROF).
import cProfile, os, pstats, sys, time

import compile_accel.precompile as precompile
from compile_accel.benchmarks import runner

_load = precompile.load_precompiled


def profiled(*args, **kwargs):
    profile = cProfile.Profile()
    start = time.perf_counter()
    try:
        return profile.runcall(_load, *args, **kwargs)
    finally:
        with open(os.environ["LOADPROF"], "w") as out:
            out.write(f"load_precompiled: {time.perf_counter() - start:.2f} s under the profiler\n")
            stats = pstats.Stats(profile, stream=out)
            stats.sort_stats("cumulative").print_stats(70)
            stats.sort_stats("tottime").print_stats(30)


precompile.load_precompiled = profiled
runner.main(sys.argv[1:])
