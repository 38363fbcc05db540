"""The bench's child with compile_accel's cache-key prefetch turned off (an A/B experiment)."""
from compile_accel import api
from compile_accel.benchmarks import runner

api.prefetch_cache_keys = lambda: None
runner.main()
