"""Find the call that makes a compile worker create its CUDA context (run in the worker)."""
import ctypes, os, sys, traceback

_cu = ctypes.CDLL("libcuda.so.1")
_cu.cuInit(0)
_dev = ctypes.c_int()
_cu.cuDeviceGet(ctypes.byref(_dev), 0)
_flags, _act = ctypes.c_uint(), ctypes.c_int()
_cu.cuDevicePrimaryCtxGetState(_dev, ctypes.byref(_flags), ctypes.byref(_act))
AT_IMPORT = _act.value
IMPORTED_MODULES = sorted(m for m in sys.modules if m.startswith(("torch.cuda", "triton", "torch._inductor")))[:400]


def active():
    flags, act = ctypes.c_uint(), ctypes.c_int()
    _cu.cuDevicePrimaryCtxGetState(_dev, ctypes.byref(flags), ctypes.byref(act))
    return act.value


def run_with_probe(pickled, env):
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
    found = []
    start = active()

    def prof(frame, event, arg):
        if event in ("return", "c_return") and not found and active():
            what = getattr(arg, "__qualname__", repr(arg)) if event == "c_return" else frame.f_code.co_name
            found.append(f"{event} {what}\n" + "".join(traceback.format_stack(frame)))
            sys.setprofile(None)

    if not start:
        sys.setprofile(prof)
    try:
        return _SubprocessFxCompile._run_in_child_subprocess(pickled, env)
    finally:
        sys.setprofile(None)
        with open(os.path.join(os.environ["PROBE_OUT"], f"probe_{os.getpid()}.txt"), "a") as f:
            f.write(f"active at import of the probe: {AT_IMPORT}; torch.cuda initialized: {__import__('torch').cuda.is_initialized()}\n")
            f.write(" ".join(IMPORTED_MODULES) + "\n")
            f.write(f"active at start: {start}; active at end: {active()}\n")
            f.write(found[0] if found else "no activation seen\n")
