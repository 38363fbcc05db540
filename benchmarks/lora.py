"""LoRA the way kohya sd-scripts applies it, for the embedded DiT and the tests.

The LoRA module is not a child of the model: it replaces the base Linear's `forward`
with its own bound method and keeps the original as `org_forward`, so the model's
state dict is unchanged and dynamo meets a bound method of another module inside the
block (the pattern that used to graph-break compiled checkpointed blocks).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.nn as nn


class KohyaStyleLoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, up_init_std: float = 0.0) -> None:
        super().__init__()
        self.lora_down = nn.Linear(base.in_features, rank, bias=False)
        self.lora_up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=5**0.5)
        # kohya starts lora_up at zero; tests start it random so every LoRA gradient is non-zero.
        if up_init_std:
            nn.init.normal_(self.lora_up.weight, std=up_init_std)
        else:
            nn.init.zeros_(self.lora_up.weight)
        self.multiplier = 1.0
        self.scale = alpha / rank
        self.org_forward = base.forward
        base.forward = self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * (self.multiplier * self.scale)


class KohyaStyleLoRANetwork(nn.Module):
    """All LoRA modules of a model, held outside it (as kohya's LoRANetwork does)."""

    def __init__(
        self, model: nn.Module, targets: list[str], rank: int = 4, alpha: float = 4.0, up_init_std: float = 0.0
    ) -> None:
        super().__init__()
        self.loras = nn.ModuleDict()
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and any(fnmatchcase(name, t) for t in targets):
                self.loras[name.replace(".", "_")] = KohyaStyleLoRA(module, rank, alpha, up_init_std)
        if not self.loras:
            raise ValueError(f"no nn.Linear in {type(model).__name__} matches {targets}")


# The attention and MLP projections of the embedded DiT's blocks.
TINY_DIT_LORA_TARGETS = ["*_blocks.*.*qkv.qkv", "*_blocks.*.*_out", "*_blocks.*.linear1", "*_blocks.*.linear2"]
