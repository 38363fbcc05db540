"""Stream a model's blocks between host and GPU memory around their calls.

Most blocks live in host memory and are copied into one of two GPU slots just before they
run; `1 - offload_fraction` of the blocks stay on the GPU: the smallest ones, spread evenly
over the execution order, so that copies go on while they compute. Optionally what each block
keeps for backward goes to host memory between its forward and its backward too.

    conductor = BlockOffloadConductor(offload_fraction=0.9, activation_offload=True).attach(model)
    ...train...
    conductor.remove()

Modules, one concern each:
    layout.py       where a block's frozen weights sit: byte layout, host copy, which blocks stay
    transfers.py    side streams, events, copies and (pinned) host memory
    slots.py        weight streaming: the two GPU slots, loads, evictions, int8 dequantizing
    activations.py  ActivationOffload: saved activations to host memory and back
    conductor.py    BlockOffloadConductor: set-up, visit order, hooks, remove, stats, the ladder
"""

from .activations import MIN_ACTIVATION_BYTES
from .conductor import OFFLOAD_DTYPES, BlockOffloadConductor, offload_fraction_ladder
from .layout import ALIGN
from .slots import SLOTS

__all__ = [
    "ALIGN",
    "MIN_ACTIVATION_BYTES",
    "OFFLOAD_DTYPES",
    "SLOTS",
    "BlockOffloadConductor",
    "offload_fraction_ladder",
]
