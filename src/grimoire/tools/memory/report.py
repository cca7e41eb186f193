"""The estimate as text: one run's table by part, and the fit grid of ``docs/multi-gpu.md``.

The verdict keeps :func:`reserve` back from the device's memory: what no tensor count sees (the
CUDA context and NCCL's buffers, about 2 GiB) and the caching allocator's fragmentation (5%).
A peak under ``device - reserve`` *fits*; up to the full device it is *tight* (it may run, or
may need ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` or a smaller micro-batch); above,
it *does not fit*.
"""

from __future__ import annotations

from dataclasses import dataclass

from grimoire.config.model_shape import LINEARS, LoraShape, ModelShape
from grimoire.tools.memory.estimate import GIB, Estimate, Setup, estimate

#: Kept back from the device for the CUDA context and NCCL (bytes), and for fragmentation.
CONTEXT_BYTES, FRAGMENTATION = 2 * GIB, 0.05


def reserve(device_bytes: float) -> float:
    return CONTEXT_BYTES + FRAGMENTATION * device_bytes


def verdict(peak: float, device_bytes: float) -> str:
    if peak <= device_bytes - reserve(device_bytes):
        return "fits"
    return "tight" if peak <= device_bytes else "does not fit"


def gib(nbytes: float) -> str:
    """GiB with one decimal; a non-zero amount under 0.1 GiB with enough decimals to show it
    (a tiny model is not 0.0 GiB)."""
    value = nbytes / GIB
    if 0 < value < 0.1:
        return f"{value:.2g}"
    return f"{value:.1f}"


def count(n: float) -> str:
    """A parameter count with the unit that fits it: ``8.03B``, ``124M``, ``105.5K``, ``512``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if n / size >= 100 else f"{n / size:.4g}{unit}"
    return f"{n:.0f}"


def describe_model(shape: ModelShape) -> str:
    return (
        f"{shape.name}: {count(shape.total_params)} parameters (hidden {shape.hidden}, "
        f"{shape.layers} layers, {shape.heads} heads / {shape.kv_heads} KV, MLP "
        f"{shape.intermediate}, vocab {shape.vocab}{', tied' if shape.tied else ''}; "
        f"checkpoint dtype {shape.dtype})"
    )


def describe_setup(setup: Setup) -> str:
    if setup.sharded:
        group = setup.shards
        how = f"fsdp2 over {setup.world_size} ranks"
        if group < setup.world_size:
            how += f" (HSDP: shards of {group}, {setup.world_size // group} replicas)"
        how += ", CPU offload" if setup.cpu_offload else ""
    else:
        how = f"ddp over {setup.world_size} ranks" if setup.world_size > 1 else "1 process"
    lora = setup.lora
    what = (f"LoRA r={lora.r} on {'/'.join(lora.targets)}" if lora else "full fine-tuning") + (
        f", {setup.quant_bits}-bit base" if setup.quant_bits else ""
    )
    split = ""
    if setup.sequence_parallel > 1:
        split = (
            f"; each row split over {setup.sequence_parallel} ranks (sequence parallel: "
            f"{setup.rank_tokens} tokens per rank)"
        )
    return (
        f"{how}; {what}; {setup.weight_dtype} weights, mixed_precision {setup.mixed_precision}; "
        f"{setup.optimizer}; checkpointing {'on' if setup.checkpointing else 'off'}; "
        f"{setup.tokens} tokens per micro-batch"
        + (f" x {setup.grad_accum} accumulation steps" if setup.grad_accum > 1 else "")
        + split
    )


def render(est: Estimate, device_bytes: float, nodes: int = 1, tokens_from: str = "") -> str:
    """The table of one estimate, the peak of each phase, the verdict, and the other setting of
    activation checkpointing for comparison."""
    setup = est.setup
    lines = [
        describe_model(est.shape),
        describe_setup(setup) + (f" ({tokens_from})" if tokens_from else ""),
        "",
        "| part | device GiB/rank | host GiB/rank | note |",
        "|---|---:|---:|---|",
    ]
    for p in est.parts:
        lines.append(f"| {p.name} | {gib(p.device)} | {gib(p.host)} | {p.note} |")
    total_dev = sum(p.device for p in est.parts)
    lines.append(f"| sum of parts | {gib(total_dev)} | {gib(est.host)} | not all live at once |")
    lines.append("")
    lines.append(
        "peak by phase (GiB/rank): " + ", ".join(f"{k} {gib(v)}" for k, v in est.phases.items())
    )
    word = verdict(est.peak, device_bytes)
    lines.append(
        f"peak: {gib(est.peak)} GiB per rank ({est.peak_phase}) on a {gib(device_bytes)} GiB "
        f"device: {word.upper()} (keeping {gib(reserve(device_bytes))} GiB back for the CUDA "
        "context and fragmentation)"
    )
    if est.host:
        per_node = est.host * max(1, setup.world_size // max(nodes, 1))
        lines.append(f"host memory: {gib(est.host)} GiB per rank, {gib(per_node)} GiB per node")
    other = estimate(est.shape, setup.with_(checkpointing=not setup.checkpointing))
    lines.append(
        f"with gradient_checkpointing {'off' if setup.checkpointing else 'on'}: activations "
        f"{gib(other.part('activations').device)} GiB, peak {gib(other.peak)} GiB: "
        f"{verdict(other.peak, device_bytes)}"
    )
    lines += [f"note: {n}" for n in est.notes]
    if word == "does not fit":
        lines += suggestions(est, device_bytes)
    return "\n".join(lines)


# --------------------------------------------------------------------------- the fit grid


@dataclass(frozen=True)
class GridRow:
    label: str
    changes: dict


GRID_LORA = LoraShape(r=16, targets=LINEARS)


def grid_rows(world: int, nodes: int) -> list[GridRow]:
    """The settings the docs compare: DDP, 8-bit AdamW, FSDP2, HSDP, offload, LoRA."""
    rows = [
        GridRow("DDP, AdamW", {"distributed": "ddp"}),
        GridRow("DDP, 8-bit AdamW", {"distributed": "ddp", "optimizer": "adamw_8bit"}),
        GridRow(f"FSDP2 over {world}, AdamW", {"distributed": "fsdp2"}),
    ]
    if nodes > 1:
        rows.append(
            GridRow(
                f"HSDP: shard over {world // nodes}, replicate x{nodes}",
                {"distributed": "fsdp2", "shard_group": world // nodes},
            )
        )
    rows += [
        GridRow(f"FSDP2 over {world} + CPU offload", {"distributed": "fsdp2", "cpu_offload": True}),
        GridRow("LoRA r=16 all-linear, DDP", {"distributed": "ddp", "lora": GRID_LORA}),
        GridRow(
            f"LoRA r=16 all-linear, FSDP2 over {world}", {"distributed": "fsdp2", "lora": GRID_LORA}
        ),
    ]
    return rows


def fit_grid(shape: ModelShape, base: Setup, nodes: int, device_bytes: float) -> str:
    """A markdown table: every :func:`grid_rows` setting with checkpointing off and on."""
    lines = [
        "| setting | no checkpointing: peak GiB/GPU | fits? | checkpointing: peak GiB/GPU "
        "| fits? | host GiB/node |",
        "|---|---:|---|---:|---|---:|",
    ]
    per_node = max(1, base.world_size // nodes)
    for row in grid_rows(base.world_size, nodes):
        cells = []
        host = 0.0
        for ckpt in (False, True):
            est = estimate(shape, base.with_(checkpointing=ckpt, **row.changes))
            cells += [gib(est.peak), verdict(est.peak, device_bytes)]
            host = est.host * per_node
        lines.append(f"| {row.label} | " + " | ".join(cells) + f" | {gib(host) if host else '-'} |")
    return "\n".join(lines)


#: Settings tried when a run does not fit, in the order a user would reach for them:
#: (what to write, the change to the estimate's setup).
FIXES: tuple[tuple[str, dict], ...] = (
    ("training.gradient_checkpointing: true", {"checkpointing": True}),
    (
        "training.distributed: fsdp2 (shard the weights, gradients and optimizer)",
        {"distributed": "fsdp2"},
    ),
    ("training.fsdp_cpu_offload: true (with fsdp2)", {"distributed": "fsdp2", "cpu_offload": True}),
    ("a peft: section (LoRA r=16 on every linear layer)", {"lora": GRID_LORA}),
)


def suggestions(est: Estimate, device_bytes: float) -> list[str]:
    """For a run that does not fit: each of :data:`FIXES` (cumulative with checkpointing) that
    makes it fit, with its peak; or a line saying none does."""
    setup, out = est.setup, []
    for label, change in FIXES:
        if all(getattr(setup, k) == v for k, v in change.items()):
            continue  # already so
        changes = {"checkpointing": True, **change}
        if change.get("distributed") == "fsdp2" and setup.world_size == 1:
            continue  # sharding needs several processes
        peak = estimate(est.shape, setup.with_(**changes)).peak
        if verdict(peak, device_bytes) == "fits":
            out.append(f"  - {label}: peak {gib(peak)} GiB per rank, fits")
    if not out:
        return [
            "suggestion: none of checkpointing, fsdp2, CPU offload or LoRA makes it fit on "
            "this device: more or larger devices (--world-size, --device-memory), or a "
            "smaller micro-batch (training.batch_size / training.max_tokens_per_device)"
        ]
    return ["what fits (each change alone, with gradient checkpointing on):", *out]


__all__ = [
    "CONTEXT_BYTES",
    "FIXES",
    "FRAGMENTATION",
    "count",
    "describe_model",
    "describe_setup",
    "fit_grid",
    "grid_rows",
    "render",
    "reserve",
    "suggestions",
    "verdict",
]
