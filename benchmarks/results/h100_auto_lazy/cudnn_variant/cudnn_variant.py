"""The experiment behind commit 57dc2b2, applied to the code of 2ec448c: the traced step with cuDNN
attention allowed, its uncompiled backward given cuDNN backward inputs laid out as inductor's
sdpa_constraint gives them, each change logged to $OUT/cudnn_fix.txt. Loaded by the
sitecustomize.py beside it when CUDNN_VARIANT=1 and this folder is on PYTHONPATH (the bench
children inherit both). 57dc2b2 keeps the gradient's re-layout and drops the query/key/value/
output check, which never fired (cudnn_fix.txt)."""
import contextlib, sys, torch
from compile_accel import saved_bytes as sb
from compile_accel import auto_budget as ab

CUDNN_BWD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
seen = set()

def _log(message):
    import os
    with open(os.path.join(os.environ.get('OUT', '/tmp'), 'cudnn_fix.txt'), 'a') as f:
        f.write(message + '\n')

calls = [0]

def _like(grad, out):
    calls[0] += 1
    if calls[0] == 1:
        _log(f'first cuDNN backward: dO {tuple(grad.shape)} {grad.stride()} out {out.stride()}')
    if grad.stride() == out.stride():
        return grad
    key = ("dO", tuple(grad.stride()), tuple(out.stride()))
    if key not in seen:
        seen.add(key); _log(f"CUDNN-FIX dO strides {grad.stride()} -> out strides {out.stride()}")
    return torch.empty_strided(out.shape, out.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)

def _dense_aligned(t):
    if t.stride(-1) == 1 and t.storage_offset() % 8 == 0:
        return t
    key = ("qkvo", tuple(t.stride()), t.storage_offset() % 8)
    if key not in seen:
        seen.add(key); _log(f"CUDNN-FIX input {tuple(t.shape)} {t.stride()} offset {t.storage_offset()}")
    return t.contiguous() if t.stride(-1) != 1 else t.clone(memory_format=torch.preserve_format)

def rewrite(gm):
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is CUDNN_BWD:
            args = list(node.args)
            with gm.graph.inserting_before(node):
                for i in (1, 2, 3, 4):
                    args[i] = gm.graph.call_function(_dense_aligned, (args[i],))
                args[0] = gm.graph.call_function(_like, (args[0], args[4]))
            node.args = tuple(args)
            n += 1
    if n:
        gm.recompile()
    return gm

orig_backend = sb.SavedBytesEstimate.backend
def backend(self):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import select_decomp_table
    return aot_autograd(
        fw_compiler=self._forward,
        bw_compiler=lambda gm, example_inputs: make_boxed_func(rewrite(gm).forward),
        inference_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
        partition_fn=self._partition_traced,
        decompositions=select_decomp_table(),
    )
sb.SavedBytesEstimate.backend = backend
ab.traced_step_attention = contextlib.nullcontext
print("CUDNN-VARIANT installed", file=sys.stderr, flush=True)
