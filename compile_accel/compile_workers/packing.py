"""A graph dynamo traced, as bytes a compile worker takes (`pack_graph`), and its compile from
them (`compile_packed`), the same in a worker and in the training process: both make the same
AOTAutograd cache key, so that the training process loads what the worker compiled. With it the
state outside the graph that AOTAutograd traces under and keys on (`runtime_state`)."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._functorch.config
import torch._inductor.config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

try:  # torch >= 2.8: the graph pickler (fake tensors included) and AOTAutograd's cache lookup
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx._graph_pickler import Options as PicklerOptions
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
except ImportError:
    GraphPickler = None


# The state outside the graph that AOTAutograd traces it under and keys its cache on: a worker
# compiles under the training process's.
_AUTOCAST_DEVICES = ("cpu", "cuda")


def precision_flags() -> list[tuple[Any, str]]:
    # torch >= 2.9 keys on fp32_precision (allow_tf32 sets it too); earlier ones on allow_tf32.
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return [
        (matmul, "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"),
        (matmul, "allow_fp16_reduced_precision_reduction"),
        (matmul, "allow_bf16_reduced_precision_reduction"),
        (cudnn, "fp32_precision" if hasattr(cudnn, "fp32_precision") else "allow_tf32"),
    ]


# The attention kernels scaled_dot_product_attention may choose: AOTAutograd's trace picks one
# into the graph, and its cache key does not hold them, so a worker must choose as the training
# process would. (The diffusers Flux bench turns cuDNN's off; workers that left it on compiled
# cuDNN attention into graphs whose backward failed on an H200: an illegal memory access.)
_ATTENTION_BACKENDS = ("flash", "mem_efficient", "math", "cudnn")


def _attention_backends() -> dict[str, Any]:
    cuda = torch.backends.cuda
    state: dict[str, Any] = {name: getattr(cuda, f"{name}_sdp_enabled")() for name in _ATTENTION_BACKENDS}
    state["fp16_bf16_reduction_math"] = cuda.fp16_bf16_reduction_math_sdp_allowed()
    state["priority"] = list(torch._C._get_sdp_priority_order())  # (sdpa_kernel's set_priority)
    return state


def _set_attention_backends(state: dict[str, Any]) -> None:
    cuda = torch.backends.cuda
    for name in _ATTENTION_BACKENDS:
        getattr(cuda, f"enable_{name}_sdp")(state[name])
    cuda.allow_fp16_bf16_reduction_math_sdp(state["fp16_bf16_reduction_math"])
    torch._C._set_sdp_priority_order(state["priority"])


def runtime_state() -> dict[str, Any]:
    return {
        "grad": torch.is_grad_enabled(),
        "autocast": {d: torch.get_autocast_dtype(d) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)},
        "deterministic": (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "default_dtype": torch.get_default_dtype(),
        "precision": [getattr(module, name) for module, name in precision_flags()],
        "attention": _attention_backends(),
    }


def set_flags(state: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(state["deterministic"][0], warn_only=state["deterministic"][1])
    torch.utils.deterministic.fill_uninitialized_memory = state["fill_uninitialized_memory"]
    torch.set_default_dtype(state["default_dtype"])
    for (module, name), value in zip(precision_flags(), state["precision"], strict=True):
        if getattr(module, name) != value:  # (setting one flag can change another's reading)
            setattr(module, name, value)
    _set_attention_backends(state["attention"])


@contextlib.contextmanager
def in_runtime_state(state: dict[str, Any]) -> Iterator[None]:
    """The flags set for good (in a worker each graph sets its own; here the caller puts them
    back), grad mode and autocast around the compile."""
    set_flags(state)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(state["grad"]))
        for device in _AUTOCAST_DEVICES:
            if device in state["autocast"]:
                stack.enter_context(torch.autocast(device, dtype=state["autocast"][device]))
            elif torch.is_autocast_enabled(device):  # (in the training process: run_here)
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


# Node metadata a worker needs: the stack traces (in the generated code's comments) and which
# inputs dynamo found static (parameters: the partitioner treats them as free to keep). The rest
# is dropped (fake values, which the worker propagates anew, and module classes it may not import).
_KEPT_NODE_META = ("stack_trace",)
_STATIC_INPUT_KEY = "_dynamo_static_input_type"


def _kept_meta(meta: dict[str, Any]) -> dict[str, Any]:
    kept = {key: meta[key] for key in _KEPT_NODE_META if key in meta}
    tensor_dict = meta.get("tensor_dict") or {}
    if _STATIC_INPUT_KEY in tensor_dict:
        kept["tensor_dict"] = {_STATIC_INPUT_KEY: tensor_dict[_STATIC_INPUT_KEY]}
    return kept


@dataclass
class WrapperStandIn:
    """An input of a traceable wrapper subclass (an offloaded block's Int8Weight,
    compile_accel.int8_weight) as fakes of its inner tensors: torch's pickler takes fakes of
    plain tensors only. `rebuilt()` is the subclass over them, as dynamo's fake of it was."""

    cls: type
    inner: dict[str, torch.Tensor]
    meta: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def rebuilt(self) -> torch.Tensor:
        return self.cls.__tensor_unflatten__(self.inner, self.meta, self.size, self.stride)


def _is_plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def _stand_in(fake_mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor | WrapperStandIn:
    """A fake of `tensor`, static shapes, without its `.grad`: a parameter's gradient (accumulated
    over micro-batches, or not zeroed yet after a step) is no input of the graph, and its fake does
    not pickle."""
    if not _is_plain(tensor):
        names, meta = tensor.__tensor_flatten__()
        inner = {name: _stand_in(fake_mode, getattr(tensor, name)) for name in names}
        return WrapperStandIn(type(tensor), inner, meta, tuple(tensor.shape), tuple(tensor.stride()))
    fake = fake_mode.from_tensor(tensor, static_shapes=True)
    fake.grad = None
    return fake


def pack_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> bytes | str:
    """The graph, fake stand-ins for its inputs and what AOTAutograd reads of dynamo's graph
    module, as bytes for a worker; or why it cannot go (a string)."""
    if any(not isinstance(x, torch.Tensor) for x in example_inputs):
        return "it has non-tensor inputs (symbolic shapes)"
    if any(not (_is_plain(x) or is_traceable_wrapper_subclass(x)) for x in example_inputs):
        return "it has inputs of a tensor subclass that is no traceable wrapper"
    try:  # what a worker compiles comes back through AOTAutograd's cache only
        check_cacheable(gm)
    except BypassAOTAutogradCache as error:  # (torch <= 2.11: a checkpoint traced in the graph)
        return f"AOTAutograd would not cache it: {str(error).splitlines()[0]}"
    fake_mode = FakeTensorMode()  # without a shape env: static shapes, as dynamo gives AOTAutograd
    fakes = [_stand_in(fake_mode, x) for x in example_inputs]
    placeholders = gm.graph.find_nodes(op="placeholder")
    sources = [getattr(node, "_dynamo_source", None) for node in placeholders]
    plain = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()).__dict__
    # AOTAutograd's cache key pickles the graph module's attributes in their order.
    attributes = {name: value for name, value in gm.__dict__.items() if name not in plain or name == "meta"}
    order = list(gm.__dict__)
    # Nested graphs too: the bodies of higher-order ops (a checkpoint traced in the region).
    metas = {node: node.meta for graph in gm.modules() if isinstance(graph, torch.fx.GraphModule) for node in graph.graph.nodes}
    try:
        for node in metas:
            node.meta = _kept_meta(node.meta)
        return GraphPickler.dumps((gm, fakes, sources, attributes, order), PicklerOptions(ops_filter=None))
    except Exception as error:  # an op or value torch's pickler cannot take
        return f"{type(error).__name__}: {error}"
    finally:
        for node, meta in metas.items():
            node.meta = meta


def unpack_graph(packed: bytes) -> tuple[torch.fx.GraphModule, list[Any]]:
    """pack_graph's graph module, as dynamo made it for AOTAutograd's cache key, and fake inputs."""
    inputs_mode = FakeTensorMode()
    loaded, fakes, sources, attributes, order = GraphPickler.loads(packed, inputs_mode)
    fakes = [fake.rebuilt() if isinstance(fake, WrapperStandIn) else fake for fake in fakes]
    root = torch.nn.Module()  # holding the nested graphs the graph's get_attr nodes name
    for name, child in loaded.named_children():
        root.add_module(name, child)
    gm = torch.fx.GraphModule(root, loaded.graph)  # the class dynamo's has
    merged = {**gm.__dict__, **attributes}
    gm.__dict__.clear()
    gm.__dict__.update({name: merged.pop(name) for name in order if name in merged})
    gm.__dict__.update(merged)
    for node, source in zip(gm.graph.find_nodes(op="placeholder"), sources, strict=True):
        node._dynamo_source = source
    FakeTensorProp(gm, inputs_mode).propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta.pop("val")  # where dynamo keeps it
    return gm, fakes


def compile_packed(packed: bytes, compiler: Callable) -> Callable:
    """Compile the packed graph, the same way in a worker and here: both make the same
    AOTAutograd cache key, so that here it loads what the worker compiled."""
    gm, fakes = unpack_graph(packed)
    # Caches need a shape env in the tracing context; the inputs have none, so their shapes
    # stay static (as dynamo's real inputs do: AOTAutograd's key records it).
    context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch._guards.tracing(context):
        return compiler(gm, fakes)


def job(packed: bytes, compiler: Callable, state: dict[str, Any] | None = None) -> bytes:
    """A graph's compile for a worker: the graph, the compiler and the settings in force now,
    under `state` (grad mode, autocast, ...; default: as they are now)."""
    return pickle.dumps(
        (
            packed,
            compiler,
            torch._inductor.config.save_config_portable(),
            torch._functorch.config.save_config_portable(),
            runtime_state() if state is None else state,
        )
    )
