"""Where the GPU memory of an offloaded LoRA step goes (a diagnostic, GPU only).

    python -m benchmarks.offload_memory --model flux --res 2048 --mode blocks [--budget 0.0]

Builds the bench model with checkpointing (or, with --budget, blocks compiled under that
activation memory budget instead) and a BlockOffloadConductor (activation offload on),
runs two steps, then prints what stays allocated between steps, by owner, and for one more step
the bytes allocated when each block is visited and the highest peak between two visits.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from compile_accel import BlockOffloadConductor, CompileConfig

from .models import MODELS

GiB = 2**30


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="flux")
    parser.add_argument("--res", type=int, default=2048)
    parser.add_argument("--mode", choices=["off", "selective", "blocks"], default="blocks", help="compile mode")
    parser.add_argument("--offload-fraction", type=float, default=0.9)
    parser.add_argument(
        "--budget", type=float, default=None, help="blocks mode: this activation memory budget instead of checkpointing"
    )
    args = parser.parse_args(argv)
    config = CompileConfig(mode=args.mode, activation_memory_budget=args.budget)
    try:  # before the model is built: a bad flag costs nothing
        config.validate()
    except ValueError as error:
        parser.error(str(error))

    torch.manual_seed(0)
    bench = MODELS[args.model]("cuda", 16, None, args.res)
    model = bench.model
    model.train()
    if args.budget is None:
        bench.enable_checkpointing()
    bench.accelerate(model, dataclasses.replace(config, exclude=bench.exclude))
    conductor = BlockOffloadConductor(args.offload_fraction, activation_offload=True).attach(model)
    torch.cuda.empty_cache()
    optimizer = torch.optim.AdamW(bench.lora_params, lr=1e-4)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = bench.predict()
        (out.float() - bench.target.float()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()

    in_blocks = {id(p) for block in conductor.blocks for p in block.module.parameters()}
    lora = {id(p) for p in bench.lora_params}
    at_rest = {
        "resident blocks' frozen weights": sum(b.home.numel() for b in conductor.blocks if b.home is not None),
        "slots for streamed blocks": sum(s.numel() for s in conductor._slots.buffers),
        "LoRA weights": sum(p.numel() * p.element_size() for p in bench.lora_params),
        "optimizer state": sum(
            t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.is_cuda
        ),
        "other frozen weights (outside the blocks)": sum(
            p.numel() * p.element_size()
            for p in model.parameters()
            if p.is_cuda and id(p) not in in_blocks and id(p) not in lora
        ),
    }
    total = torch.cuda.memory_allocated()
    at_rest["the rest (inputs, buffers, ...)"] = total - sum(at_rest.values())
    how = "checkpointing" if args.budget is None else f"activation memory budget {args.budget}"
    print(f"{bench.description}, compile mode {args.mode}, {how}, offload fraction {args.offload_fraction}")
    print(f"allocated between steps: {total / GiB:.2f} GiB")
    for name, nbytes in at_rest.items():
        print(f"  {name:45s} {nbytes / GiB:6.3f} GiB")

    visits = []  # (block, in backward, allocated on entry, peak since the previous visit)
    before_block = conductor.before_block

    def traced(index: int, inputs=()) -> None:
        backward = torch._C._current_graph_task_id() != -1
        visits.append((index, backward, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()
        before_block(index, inputs)

    conductor.before_block = traced
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    conductor.before_block = before_block
    visits.append((None, True, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
    for backward in (False, True):
        entries = " ".join(f"{v[2] / GiB:.2f}" for v in visits[:-1] if v[1] == backward)
        print(f"allocated on entry to each block, {'backward' if backward else 'forward'} (GiB): {entries}")

    def peak_line(what: str, peak: int) -> str:
        (index, backward, entry, _), peak_bytes = visits[peak - 1], visits[peak][3]
        return (
            f"{what} {peak_bytes / GiB:.2f} GiB, in block {index}'s {'backward' if backward else 'forward'} "
            f"visit: {entry / GiB:.2f} GiB on entry + {(peak_bytes - entry) / GiB:.2f} GiB while it ran"
        )

    print(peak_line("step peak", max(range(1, len(visits)), key=lambda i: visits[i][3])))
    # Per block class (Flux: double- and single-stream blocks), which bounds what any slot layout gains.
    classes = {type(block.module).__name__ for block in conductor.blocks}
    for name in sorted(classes):
        of_class = [
            i for i in range(1, len(visits)) if type(conductor.blocks[visits[i - 1][0]].module).__name__ == name
        ]
        print(peak_line(f"  highest in a {name} visit:", max(of_class, key=lambda i: visits[i][3])))


if __name__ == "__main__":
    main()
