"""The tables of a bench report: the main table of every mode (OOM rows included), then notes and
tables of the modes that ran: the memory cap, the auto budgets' choices, compile phases cold and
warm, offload, parallel throughput and GPU kernel time."""

from __future__ import annotations

from typing import Any

from compile_accel.compile_profile import PHASES

from . import gpu_like
from .measure import KERNEL_KINDS


def _format_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def measured(report: dict[str, Any]) -> dict[str, Any]:
    """The report without the modes that ran out of memory."""
    return {**report, "results": [r for r in report["results"] if "oom" not in r]}


def markdown_table(report: dict[str, Any], baseline: str = "eager+ckpt") -> str:
    """The main table (a mode that ran out of memory is a row marked OOM), the note on a memory
    cap, then the offload, parallel and GPU-time tables of the modes that ran."""
    ran = measured(report)
    base = next((r for r in ran["results"] if r["mode"] == baseline), None)
    kind = ran["results"][0]["peak_kind"] if ran["results"] else ""
    lines = [
        f"| mode | median s/step | min s/step | vs {baseline} | peak ({kind}) | reserved | first step s "
        "| warm first step s | MFU | graphs | recompiles | graph breaks | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "oom" in r:
            message = r["oom"].replace("|", "\\|")  # a bar would end the cell
            lines.append(f"| {r['mode']} | OOM: {message} |" + " - |" * 11)
            continue
        speedup = f"{base['step_s_median'] / r['step_s_median']:.2f}x" if base else "-"
        s = r["stats"]
        lines.append(
            f"| {r['mode']} | {r['step_s_median']:.4f} | {r['step_s_min']:.4f} | {speedup} | {_format_bytes(r['peak_bytes'])} "
            f"| {_format_bytes(r['reserved_bytes'])} | {r['first_step_s']:.1f} "
            f"| {'-' if r.get('warm_first_step_s') is None else format(r['warm_first_step_s'], '.1f')} "
            f"| {'-' if r.get('mfu') is None else format(r['mfu'], '.1%')} | {s.get('unique_graphs', 0)} "
            f"| {s.get('recompiles', 0)} | {s.get('graph_breaks', 0)} | {len(s.get('fallbacks', []))} |"
        )
    extra = [
        f"Not run (the bench stopped first): {', '.join(report['modes_left'])}." if "modes_left" in report else "",
        cap_note(report),
        auto_note(ran),
        compile_profile_table(ran),
        compile_workers_table(ran),
        offload_table(ran),
        parallel_table(ran),
        gpu_time_table(ran),
    ]
    return "\n\n".join(["\n".join(lines), *(table for table in extra if table)])


def compile_workers_table(report: dict[str, Any]) -> str:
    """The modes that compiled in workers (--compile-workers): first and second step, when the
    last compiled graph was back, from the first step's start, and the slowest graph's compile in
    its worker (after its wait in the worker's queue) by phase."""
    rows = [r for r in report["results"] if "compile_workers" in r["stats"]]
    if not rows:
        return ""
    lines = [
        "Compiled in worker processes (steps run what is not back yet uncompiled):",
        "",
        "| mode | first step s | second step s | all graphs compiled after s | last graph back after s "
        "| graphs in workers | failed there | slowest graph in a worker s (queued s; phases) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, w = r["stats"], r["stats"]["compile_workers"]
        compiles = s.get("worker_compiles") or []
        slowest = max(compiles, key=lambda c: c["worker_s"], default=None)
        # (seconds into the first step: a first step that waited far past it waited for the loads here)
        last_back = max((c["back_at_s"] for c in compiles if "back_at_s" in c), default=None)
        in_worker = "-"
        if slowest is not None:
            phases = ", ".join(f"{p} {slowest[p + '_s']:.1f}" for p in PHASES if slowest[p + "_s"] >= 0.05)
            in_worker = f"{slowest['worker_s']:.1f} ({slowest['queued_s']:.1f}; {phases})"
        lines.append(
            f"| {r['mode']} | {r['first_step_s']:.1f} | {_seconds(w['second_step_s'])} | {w['compiled_after_s']:.1f} "
            f"| {_seconds(last_back)} | {s.get('worker_graphs_compiled', 0)} of {s.get('worker_graphs_started', 0)} "
            f"| {len(s.get('worker_failures', []))} | {in_worker} |"
        )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cap_note(report: dict[str, Any]) -> str:
    """What a run under --vram-cap-gib measured: a smaller card's memory at this GPU's speed; under
    --gpu-like, the card's emulation as measured."""
    if "gpu_like" in report:
        return gpu_like.note(report["gpu_like"])
    cap = report.get("settings", {}).get("vram_cap_gib")
    if cap is None:
        return ""
    gpu = report.get("environment", {}).get("device_name", "the GPU it ran on")
    return (
        f"Under --vram-cap-gib {cap:g}: each process could allocate at most {cap:g} GiB per GPU, so the memory "
        f"columns and OOM rows are what a {cap:g} GiB card would see, while the speeds are those of {gpu}."
    )


def auto_note(report: dict[str, Any]) -> str:
    """What each +auto row chose, over which limit, and what its calibration measured."""
    notes = []
    for r in report["results"]:
        auto = r["stats"].get("auto_budget")
        if not auto:
            continue
        setting = f"budget {auto['budget']}"
        if auto.get("offload_name"):
            setting += f" at {auto['offload_name']} {auto['offload']:g}"
        def where(row: dict[str, Any]) -> str:
            return f"{row['budget']}" + ("" if row["offload"] is None else f"@{row['offload']:g}")

        predicted = ", ".join(f"{where(row)}: {row['peak_bytes'] / 2**30:.2f} GiB" for row in auto.get("predicted", []))
        tried = ", ".join(
            where(row) + (": OOM" if row["out_of_memory"] else f": {row['seconds']:.3f} s {row['peak_bytes'] / 2**30:.2f} GiB")
            for row in auto["table"]
        )
        notes.append(
            f"{r['mode']} chose {setting} ({'fits' if auto['fits'] else 'nothing fit'} {auto['limit_gib']:g} GiB; "
            f"{_calibration_time(auto)}); "
            f"predicted peak budget@offload: {predicted or 'none'}; measured: {tried}."
        )
    return "\n\n".join(notes)


def _calibration_time(auto: dict[str, Any]) -> str:
    if auto["cached"]:
        return "cached"
    seconds, waited = auto.get("calibration_seconds", 0), auto.get("waited_seconds", 0)
    if waited < seconds - 0.05:  # the candidates' graphs compiled in the workers while training ran
        return f"calibration {seconds:.1f} s, of which the steps waited {waited:.1f} s"
    return f"calibration {seconds:.1f} s"


def compile_profile_table(report: dict[str, Any]) -> str:
    """With a warm start measured: each mode's first step cold and warm, split into compile
    phases (compile_accel.compile_profile) and the rest of the step ("run": executing it)."""
    lines = [
        "| mode | start | first step s | compiling s | "
        + " | ".join(f"{phase} s" for phase in PHASES)
        + " | of which at first backward s | run s | inductor graphs from cache |",
        "|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|",
    ]
    for r in report["results"]:
        if r.get("warm_compile_times") is None:
            continue
        for start, first, times in (
            ("cold", r["first_step_s"], r["stats"]["compile_times"]),
            ("warm", r["warm_first_step_s"], r["warm_compile_times"]),
        ):
            looked_up = times["fx_graphs_compiled"] + times["fx_graphs_from_cache"]
            lines.append(
                f"| {r['mode']} | {start} | {first:.1f} | {times['total_s']:.1f} | "
                + " | ".join(f"{times[f'{phase}_s']:.1f}" for phase in PHASES)
                + f" | {times['lazy_backward_s']:.1f} | {max(first - times['total_s'], 0.0):.1f} "
                f"| {times['fx_graphs_from_cache']} of {looked_up} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def offload_table(report: dict[str, Any]) -> str:
    """Rows with +offload: step time against the same mode without offload (compute only, when
    it ran) and against the transfers alone; the overlap bar is step <= 1.15 x the larger."""
    by_mode = {r["mode"]: r for r in report["results"]}
    lines = [
        "| mode | median s/step | compute-only s/step | transfer-only s | step / max(both) | GiB to GPU per step "
        "| activations GiB per step | int8 output error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        offload = r["stats"].get("offload")
        if offload is None:
            continue
        compute = by_mode.get(r["mode"].partition("+offload=")[0])
        compute_s = compute["step_s_median"] if compute else None
        bound = max(compute_s or 0.0, offload["transfer_only_s"])
        error = offload.get("int8_output_rel_error")
        lines.append(
            f"| {r['mode']} | {r['step_s_median']:.4f} | {'-' if compute_s is None else format(compute_s, '.4f')} "
            f"| {offload['transfer_only_s']:.4f} | {r['step_s_median'] / bound:.2f} "
            f"| {offload['bytes_to_device_per_step'] / 2**30:.2f} "
            f"| {offload['activation_bytes_offloaded_per_step'] / 2**30:.2f} "
            f"| {'-' if error is None else format(error, '.2e')} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def gpu_time_table(report: dict[str, Any]) -> str:
    """Rows profiled with --profile-steps: GPU kernel time per step by kind, in ms, and the median
    step less all kernel time (the GPU waiting on the host, when kernels do not overlap)."""
    kinds = [kind for kind, _ in KERNEL_KINDS] + ["other"]
    lines = [
        f"| mode | median ms/step | {' | '.join(f'{kind} ms' for kind in kinds)} | all kernels ms | step less kernels ms |",
        "|---|---|" + "---|" * (len(kinds) + 2),
    ]
    for r in report["results"]:
        gpu_time = r["stats"].get("gpu_time_per_step_s")
        if gpu_time is None:
            continue
        busy = sum(gpu_time.values())
        cells = " | ".join(f"{gpu_time[kind] * 1e3:.1f}" for kind in kinds)
        step_ms = r["step_s_median"] * 1e3
        lines.append(f"| {r['mode']} | {step_ms:.1f} | {cells} | {busy * 1e3:.1f} | {step_ms - busy * 1e3:.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def parallel_table(report: dict[str, Any]) -> str:
    """Rows with +ddp or +split: throughput against the same mode on one device (when it ran)."""
    by_mode = {r["mode"]: r for r in report["results"]}
    lines = [
        "| mode | processes | devices | samples/s | vs one device | median s/step | peak of the busiest device |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r.get("devices", 1) == 1:
            continue
        single = by_mode.get(r["mode"].split("+ddp=")[0].split("+split=")[0])
        ratio = f"{r['samples_per_s'] / single['samples_per_s']:.2f}x" if single else "-"
        lines.append(
            f"| {r['mode']} | {r['processes']} | {r['devices']} | {r['samples_per_s']:.2f} | {ratio} "
            f"| {r['step_s_median']:.4f} | {_format_bytes(r['peak_bytes'])} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""

