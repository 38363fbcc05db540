"""The bench's child with --profile-steps N: those N steps run under cProfile first (host time
by function, to stderr), then as the bench profiles them."""
import cProfile, io, pstats, sys
from compile_accel.benchmarks import runner

gpu_time_per_step = runner.gpu_time_per_step

def profiled(step, steps, gpus):
    runner.synchronize(gpus)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    runner.synchronize(gpus)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(80)
    stats.sort_stats("cumulative").print_stats(120)
    print(text.getvalue(), file=sys.stderr, flush=True)
    return gpu_time_per_step(step, steps, gpus)

runner.gpu_time_per_step = profiled
runner.main()
