"""compile_accel: torch.compile for diffusion-transformer LoRA training.

import compile_accel
compile_accel.start_preloading()  # at program start: inductor imported while the model loads
acc = compile_accel.apply(model, compile_accel.CompileConfig(mode="blocks", activation_memory_budget=0.5))
...train...
print(acc.stats()); acc.remove()
"""

from .api import Acceleration, apply
from .blocks import BlockList, find_block_lists
from .config import CompileConfig
from .offload import BlockOffloadConductor
from .preload import start_preloading

__all__ = [
    "Acceleration",
    "BlockList",
    "BlockOffloadConductor",
    "CompileConfig",
    "apply",
    "find_block_lists",
    "start_preloading",
]
__version__ = "0.1.0"
