"""Why a region runs eager, in the words of its warning and of `stats()["fallbacks"]`."""

from __future__ import annotations

import re

import torch

_SOURCE_ERROR = re.compile(r":\d+(:\d+)?: (fatal )?error:")


def failure_reason(error: BaseException) -> str:
    """The error's type and first line, and where a compiler's output follows (inductor's C++ or
    Triton build: a first line of "C++ compile error" alone), its first error line."""
    inner = getattr(error, "inner_exception", None) or error
    text = str(inner).strip().splitlines()
    reason = f"{type(inner).__name__}: {text[0] if text else ''}"
    # A source line's error (file:line:column: error: ...) before a tool's summary (collect2: error: ...).
    errors = [line.strip() for line in text[1:] if "error:" in line]
    compiler_error = next((e for e in errors if _SOURCE_ERROR.search(e)), errors[0] if errors else None)
    return reason if compiler_error is None else f"{reason} ({compiler_error[:300]})"


def no_graph_reason(break_reasons_before: dict[str, int], advice: bool = True) -> str:
    """Why a call compiled no graph, from the graph breaks dynamo counted during it; `advice`:
    with what to do about a break inside the model's checkpoint."""
    new = [r for r, n in torch._dynamo.utils.counters["graph_break"].items() if n > break_reasons_before.get(r, 0)]
    cause = f" (graph break: {new[0].strip().splitlines()[0]})" if new else ""
    if not advice:
        return f"dynamo compiled no graph for it{cause}"
    return (
        f"dynamo compiled no graph for its forward{cause}. A graph break inside "
        "torch.utils.checkpoint runs the whole checkpointed call eager: compile with an "
        "activation_memory_budget instead of the model's checkpointing, use mode='selective', or "
        "make the code behind the break traceable"
    )
