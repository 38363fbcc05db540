"""The bench's child with every compiled mode's CompileConfig.compile_mode = "reduce-overhead"
(inductor's CUDA graphs) — an experiment, not a bench mode."""
import dataclasses
from compile_accel.benchmarks import runner

parse_mode = runner.parse_mode

def reduce_overhead(mode):
    spec = parse_mode(mode)
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, compile_mode="reduce-overhead"))

runner.parse_mode = reduce_overhead
runner.main()
