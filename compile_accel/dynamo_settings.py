"""Every dynamo knob compile_accel touches, in one place, and what this torch supports.

Since torch 2.12 dynamo config is per thread: a value set on the main thread does not
reach the autograd worker threads that run a reentrant checkpoint's recompute (and
compile there). So the knobs are applied by `ensure_thread_settings()`, which every
compiled region calls on its first call in each thread.
"""

from __future__ import annotations

import inspect
import sys
import threading

import torch
import torch._functorch.config

_local = threading.local()


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# torch.compile(recompile_limit=...) scopes the limit to one compiled function, in any thread.
COMPILE_TAKES_RECOMPILE_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters
PER_THREAD_DYNAMO_CONFIG = _version() >= (2, 12)
HAS_BUDGET_KNOB = hasattr(torch._functorch.config, "activation_memory_budget")
# AOTAutograd compiles a training graph's backward at the forward compile, not lazily at the
# first backward (compile_accel.backend says why that matters).
HAS_EAGER_BACKWARD_KNOB = hasattr(torch._functorch.config, "force_non_lazy_backward_lowering")
HAS_CACHE_ARTIFACTS = hasattr(torch.compiler, "save_cache_artifacts")


def cpp_compiler() -> tuple[str | None, str | None]:
    """(the C++ compiler inductor's CPU code will use, None), or (None, why there is none):
    torch's own search of torch._inductor.config.cpp.cxx, which $CXX sets."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler(), None
    except RuntimeError as error:  # torch's InvalidCxxCompiler, or its Windows checks
        return None, str(error).strip().splitlines()[0]


# On Windows triton-windows builds its kernel launchers with a C compiler it brings, so GPU
# graphs of fixed shapes compile without MSVC; graphs with symbolic shapes do not (musubi-tuner's
# and sd-scripts' docs ask for MSVC for --compile_dynamic there).
MSVC_FOR_DYNAMIC_SHAPES = (
    "on Windows, dynamic shapes (--compile_dynamic true, and auto from a second bucket size on) need MSVC: "
    "install Visual Studio 2022 Build Tools with 'Desktop development with C++' and train from the "
    "'x64 Native Tools Command Prompt for VS 2022'"
)


def dynamic_shapes_refusal() -> str | None:
    """Why graphs with symbolic shapes cannot compile here (Windows without MSVC), or None."""
    if sys.platform != "win32" or cpp_compiler()[1] is None:
        return None
    return MSVC_FOR_DYNAMIC_SHAPES


def ensure_thread_settings(recompile_limit: int) -> None:
    """Apply compile_accel's dynamo knobs to the calling thread (once per thread and limit)."""
    if getattr(_local, "limit", 0) >= recompile_limit:
        return
    config = torch._dynamo.config
    # Blocks that read a per-instance Python int in forward (self.layer_id, self.idx) would
    # otherwise be specialised per instance: one recompile per block until the limit, then
    # silently eager. With this the int becomes a graph input and all blocks share a graph.
    config.allow_unspec_int_on_nn_module = True
    # compile_accel compiles blocks, never the DDP module. Dynamo's DDP optimizer (on by default
    # for any graph compiled inside DDP's forward) would cut each block's graph at gradient-bucket
    # boundaries: more graphs, and a budget partitioner that sees pieces of a block. DDP's
    # gradient hooks fire on the compiled backward's parameter gradients as on eager ones.
    config.optimize_ddp = False
    if not COMPILE_TAKES_RECOMPILE_LIMIT:
        # Older torch has no per-function limit; raise the global one, never lower it.
        # (torch < 2.7 calls it cache_size_limit.)
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), recompile_limit))
    # A region under a non-reentrant checkpoint runs twice, forward and recompute, and both runs
    # must pick the same graph (the checkpoint compares the tensors each saves). Dynamo checks a
    # function's graphs most-recently-used first, so once a class has a static and a dynamic
    # graph (Lumina 2's refiners and layers share one body at other token counts), a block's
    # recompute can take the other one and the checkpoint raises. Checked in the order they were
    # compiled, the first graph that fits is the same both times. Process-wide, not per thread.
    if hasattr(torch._C._dynamo.eval_frame, "_set_lru_cache"):
        torch._C._dynamo.eval_frame._set_lru_cache(False)
    _local.limit = recompile_limit
