"""Experiment (not committed): one bench child, the first forward (where every compile happens) under cProfile.
usage: prof.py OUTNAME runner-args..."""
import cProfile, io, os, pstats, sys, json, collections, contextlib, time
out = os.path.join(os.environ["OUT"], sys.argv[1])
from compile_accel.benchmarks import runner, models
prof = cProfile.Profile()
state = {"done": False}
orig_models = dict(runner.MODELS)
def wrap(make):
    def build(*a, **k):
        bench = make(*a, **k)
        predict = bench.predict
        accelerate = bench.accelerate
        def armed_accelerate(*a, **k):
            state["armed"] = True
            return accelerate(*a, **k)
        bench.accelerate = armed_accelerate
        def first_predict():
            if state["done"] or not state.get("armed"):
                return predict()
            state["done"] = True
            t = time.perf_counter()
            prof.enable()
            try:
                return predict()
            finally:
                prof.disable()
                state["seconds"] = time.perf_counter() - t
        bench.predict = first_predict
        return bench
    return build
for k, v in orig_models.items():
    runner.MODELS[k] = wrap(v)
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    runner.main(sys.argv[2:])
result = json.loads(buf.getvalue().strip().splitlines()[-1])
prof.dump_stats(out + ".prof")
with open(out + ".txt", "w") as f:
    s = pstats.Stats(prof, stream=f)
    f.write(f"first_step_s {result.get('first_step_s')} profiled forward {state.get('seconds')} step {result.get('step_s_median')}\n")
    f.write(json.dumps(result.get('stats', {}), indent=1) + "\n")
    s.sort_stats("cumulative").print_stats(150)
    s.sort_stats("tottime").print_stats(50)
    per_file = collections.Counter()
    for (file, line, fn), (cc, nc, tt, ct, callers) in s.stats.items():
        per_file[file] += tt
    f.write("\n== tottime per file\n")
    for file, t in per_file.most_common(50):
        f.write(f"{t:8.2f} {file}\n")
print("done", out, result.get("first_step_s"), state.get("seconds"))
