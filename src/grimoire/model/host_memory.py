"""Host memory: how much a CPU run may use, and what that decides.

:func:`checkpointing_decision` resolves ``gradient_checkpointing="auto"`` once, at start (the
trainer logs it and never revisits it). Activation checkpointing trades one extra decoder
forward per step (~10% of a packed SFT step on a CPU, ``docs/performance.md``) for memory. On a
CPU, RAM is rarely what runs out first for the models one trains there, compute is; so auto
turns it off when an estimate of one micro-batch's activations fits in a quarter of the
memory available to this process, and keeps it on otherwise and on every accelerator, where
memory is the binding constraint and recompute is cheap. Exact either way: checkpointing
recomputes the same values. The activations are counted by :mod:`grimoire.model.activations`,
the model ``grimoire estimate-memory`` uses, so the two cannot disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grimoire.batching.budget import method_budget_tokens
from grimoire.columns import columns_of, sequence_prefixes
from grimoire.config.model_shape import DTYPE_BYTES, dtype_name, shape_from_config
from grimoire.errors import ConfigError
from grimoire.model.activations import Numerics
from grimoire.model.activations import activation_bytes_per_token as model_activations
from grimoire.model.precision import decide

#: auto turns checkpointing off when the activation estimate is at most this share of the memory
#: available (the rest is headroom for weights, gradients, optimizer state and the logits chunks).
AUTO_CHECKPOINTING_MEMORY_SHARE = 0.25


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def available_memory(root: Path = Path("/")) -> int | None:
    """Bytes this process may still allocate on the host: ``MemAvailable`` from
    ``/proc/meminfo``, lowered to the cgroup's free room in a memory-limited container (v2
    ``memory.max - memory.current``, v1 ``limit_in_bytes - usage_in_bytes``). ``None`` when
    the system does not say (not Linux)."""
    avail = None
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if avail is None:
        return None
    cgroup = root / "sys/fs/cgroup"
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(cgroup / limit_file), _read_int(cgroup / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 "no limit" is ~2^63
            avail = min(avail, max(0, limit - usage))
    return avail


def activation_bytes_per_token(
    model: Any, config: Any = None, checkpointing: bool = False
) -> float | None:
    """Bytes of saved activations per token of ``model`` on a CPU, as ``estimate-memory``
    counts them (:func:`grimoire.model.activations.activation_bytes_per_token`: every layer
    kept, or each layer's input with ``checkpointing``), for the whole model trained in the
    dtype of its weights under ``config``'s precision (``mixed_precision``, FSDP2). ``None``
    when the model's config does not give its sizes."""
    try:
        shape = shape_from_config(getattr(model, "config", None) or {})
    except ConfigError:
        return None
    param = next(iter(model.parameters()), None)
    weight = DTYPE_BYTES[dtype_name(param.dtype if param is not None else torch.float32)]
    mixed = config is not None and decide(config.mixed_precision, cuda=False)[0] in ("bf16", "fp16")
    sharded = config is not None and config.distributed == "fsdp2"
    num = Numerics.of(weight, mixed, sharded, device="cpu")
    return model_activations(shape, num, checkpointing=checkpointing)


def micro_batch_tokens(config: Any, method: Any = None, dataset: Any = None) -> int:
    """An upper bound on the positions one forward pass holds: the token budget when set (every
    method's micro-batches stay within it); else ``batch_size`` rows, each costed by the
    method's own ``budget_tokens`` (as :class:`~grimoire.batching.budget.TokenBudget` does) with
    every sequence of the dataset's rows at ``max_length``: a pair's two sequences, KTO's KL
    row, an online prompt's ``num_generations`` completions. Without a method or dataset
    columns to ask, two sequences of ``max_length`` per row."""
    if config.max_tokens_per_device:
        return int(config.max_tokens_per_device)
    fallback = int(2 * config.batch_size * config.max_length)
    if method is None or dataset is None:
        return fallback
    try:
        prefixes = sequence_prefixes(columns_of(dataset))
        # Costed padded: never below the packed cost of the same row (sequences x longest >= sum).
        lengths = {prefix: config.max_length for prefix in prefixes}
        per_row = method_budget_tokens(method, lengths, False)
    except (TypeError, IndexError, KeyError, AttributeError):
        # A stream (no columns to read) or rows the method's cost does not describe (they are
        # checked, with a proper message, where the budget or the collator reads them).
        return fallback
    return int(config.batch_size * per_row) if prefixes else fallback


def checkpointing_decision(
    model: Any,
    config: Any,
    device_type: str,
    processes: int = 1,
    available: int | None = None,
    method: Any = None,
    dataset: Any = None,
) -> tuple[bool, str]:
    """Whether to checkpoint activations, and why (logged at start). ``processes``: how many
    training processes share this host's memory; ``available``: bytes (default:
    :func:`available_memory`); ``method`` / ``dataset``: the loss and the training rows, which
    size a micro-batch when there is no token budget (:func:`micro_batch_tokens`)."""
    value = config.gradient_checkpointing
    if value != "auto":
        return bool(value), f"gradient_checkpointing={value}"
    if device_type != "cpu":
        return True, f"auto: on ({device_type}: memory, not compute, is what runs out)"
    per_token = activation_bytes_per_token(model, config)
    if per_token is None:
        return True, "auto: on (the model config does not give its layer sizes)"
    available = available_memory() if available is None else available
    if available is None:
        return True, "auto: on (this system does not report its available memory)"
    tokens = micro_batch_tokens(config, method, dataset)
    per_process = per_token * tokens
    need = per_process * max(1, processes)
    share = AUTO_CHECKPOINTING_MEMORY_SHARE
    numbers = (
        f"activations of a {tokens}-token micro-batch ~{per_process / 2**20:,.0f} MiB"
        + (f" x {processes} processes" if processes > 1 else "")
        + f", {share:.0%} of the {available / 2**20:,.0f} MiB available is "
        f"{share * available / 2**20:,.0f} MiB"
    )
    if need <= share * available:
        return False, f"auto: off on CPU ({numbers}; saves the recompute forward)"
    return True, f"auto: on ({numbers}; set gradient_checkpointing=false to force it off)"


__all__ = [
    "activation_bytes_per_token",
    "available_memory",
    "checkpointing_decision",
    "micro_batch_tokens",
]
