import os, sys, torch, torch.nn as nn
sys.path.insert(0, os.path.dirname(__file__))
import ctx_probe
import compile_accel
from compile_accel import CompileConfig, compile_workers

submit = compile_workers._submit
compile_workers._submit = lambda fn, *args: submit(ctx_probe.run_with_probe, *args)

class Block(nn.Module):
    def __init__(self, d):
        super().__init__(); self.norm = nn.LayerNorm(d); self.fc1 = nn.Linear(d, 4 * d); self.fc2 = nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.blocks = nn.ModuleList([Block(256) for _ in range(2)])
    def forward(self, x):
        for b in self.blocks: x = b(x)
        return x

model = Net().cuda()
compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5, compile_workers=1), blocks=[model.blocks])
x = torch.randn(4, 64, 256, device="cuda")
with torch.autocast("cuda", torch.bfloat16):
    model(x).float().square().mean().backward()
print("waited for", compile_workers.wait())
