# Session 24: every garbage collection (generation, start, seconds) and every torch.cuda.synchronize time, written
# at exit to $GC_LOG/<pid>.json, to see whether collections fall into the timed steps.
import atexit, gc, json, os, time

_events, _syncs, _start = [], [], [0.0]


def _on_gc(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        _events.append((info["generation"], _start[0], time.perf_counter() - _start[0], info["collected"]))


gc.callbacks.append(_on_gc)

import torch  # noqa: E402

_sync = torch.cuda.synchronize


def _synchronize(*args, **kwargs):
    out = _sync(*args, **kwargs)
    _syncs.append(time.perf_counter())
    return out


torch.cuda.synchronize = _synchronize


@atexit.register
def _dump():
    folder = os.environ.get("GC_LOG")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump({"gc": _events, "syncs": _syncs, "tracked": len(gc.get_objects())}, f)
