"""Per-rank peak memory of a training run, part by part: the model behind ``estimate-memory``.

Everything is counted in bytes of live tensors per rank, from the model's shape
(:mod:`~grimoire.config.model_shape`) and the run's settings (:class:`Setup`); nothing is loaded.
What the model assumes, so that its limits are visible:

* **Weights** stay in the dtype they were loaded in (``model_kwargs.dtype``, default the
  checkpoint's); LoRA adapters are fp32 (peft upcasts them), a 4-/8-bit base takes 0.5 / 1 byte
  per projection weight. Gradients and AdamW's two states are in each parameter's own dtype (as
  torch's AdamW keeps them); 8-bit AdamW keeps two 1-byte states plus an fp32 scale per 256
  values (tensors under 4096 values stay 32-bit); Muon keeps one momentum for the hidden
  matrices and AdamW's two for the rest; Adafactor factored second moments; SGD nothing.
* **DDP** keeps a full copy per rank and one more gradient copy in its buckets (accelerate's
  default ``gradient_as_bucket_view=False``); under bf16 autocast the forward caches a bf16
  copy of every trained projection weight (and, without checkpointing, the bf16 copies of frozen
  ones stay saved for backward).
* **FSDP2** divides weights, gradients and optimizer state by the shard group (every rank, or
  the ranks of one node under HSDP); it gathers one unit at a time in the gather dtype (bf16
  under ``mixed_precision=bf16``): the root unit (embedding, final norm, head) for the whole
  forward and backward, plus two decoder layers (the one computing and the one prefetched), or
  every layer with ``fsdp_reshard_after_forward=false``; the root's gradients stay unsharded
  until its reduce-scatter at the end of backward, and with gradient accumulation the skipped
  reduce-scatters leave unsharded gradients behind. The fused head gathers its (root) unit around
  the chunk loop (``forward/head/sharded.py``), so log-probs come in ``fused_chunk_size`` chunks
  as on one process. Its AdamW runs the foreach kernels on DTensors: one temporary the size of
  the states' shard.
* **CPU offload** moves the sharded weights, gradients and optimizer state (and its step) to
  host memory; the device keeps the gathered units, activations and logits.
* **Activations**: :mod:`~grimoire.model.activations` (every position of a micro-batch of
  ``tokens`` positions has a target; packed rows, so grouped-query attention runs natively).
  With checkpointing each layer keeps its input, and backward recomputes one layer at a time.
* **Sequence parallelism** (``sequence_parallel``: ``N``, Ulysses): each rank of a sequence
  group runs ``ceil(tokens / N)`` of a row's positions through every layer and the head, so
  activations and logits are those of the slice; weights, gradients, optimizer states and DDP's
  buckets are replicated (full copies, as plain DDP). Inside attention a rank holds every
  token for ``H / N`` heads: the same number of q/k/v values as its slice with every head.
* **Reference model** (DPO, KTO, online methods with ``beta > 0``): a frozen copy of the policy,
  sharded like it, unless the reference is cached or is the LoRA base (adapters disabled: free).
* **Rollout** (GRPO, RLOO, ...): the KV cache of one sampling call (keys and values of every
  layer for every sequence at its full length, in the compute dtype) and the sampler's fp32
  logits, in a phase of its own.

Not every part is live at once. The peak is the largest of four moments: the start of backward
(every activation, the logits' backward, the head's gradient), the end of backward (every
gradient), the optimizer step (its temporaries), and sampling (the KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from grimoire.config.model_shape import DTYPE_BYTES, LINEARS, LoraShape, ModelShape
from grimoire.model.activations import (
    Numerics,
    activation_bytes_per_token,
    gradient_flow_bytes_per_token,
    head_bytes,
    layer_bytes_per_token,
)

GIB = 2**30
#: Optimizers keeping two states per parameter in the parameter's dtype (torch's AdamW).
ADAM_LIKE = ("adamw", "adamw_torch", "adamw_hf")
#: bitsandbytes' 8-bit states: 1 byte each plus an fp32 absmax per 256-value block; tensors
#: smaller than this many values keep fp32 states.
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096
#: Bytes per value of a 4-bit (NF4, double-quantized scales) and an 8-bit (int8 + row scale)
#: frozen projection weight.
QUANT_BYTES = {4: 0.53, 8: 1.0}


@dataclass(frozen=True)
class Rollout:
    """One sampling call of an online method: how many sequences, each how long at the end."""

    sequences: int
    length: int


@dataclass(frozen=True)
class Setup:
    """The settings that decide memory. ``mixed_precision`` is resolved (``"no"``, ``"bf16"``,
    ``"fp16"``); ``tokens``: positions in one forward pass (a micro-batch); ``shard_group``:
    ranks one copy of the weights is sharded over under FSDP2 (``None``: all, i.e. plain FSDP;
    fewer: HSDP); ``reference``: ``"none"``, ``"adapters"`` (the LoRA base), ``"cached"`` or
    ``"model"`` (a frozen copy in memory); ``device``: ``"cuda"`` or ``"cpu"`` (what the
    kernels keep differs a little); ``sequence_parallel``: ranks one packed row of ``tokens``
    positions is split over (``training.sequence_parallel_size``)."""

    world_size: int = 1
    shard_group: int | None = None
    distributed: str = "ddp"
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    weight_dtype: str = "float32"
    mixed_precision: str = "no"
    optimizer: str = "adamw"
    checkpointing: bool = True
    tokens: int = 2048
    grad_accum: int = 1
    fused: bool = True
    chunk_rows: int = 1024
    lora: LoraShape | None = None
    quant_bits: int | None = None
    reference: str = "none"
    rollout: Rollout | None = None
    score_head: bool = False
    device: str = "cuda"
    sequence_parallel: int = 1

    @property
    def rank_tokens(self) -> int:
        """Positions one rank runs through the model in a forward pass: its slice of the row
        (the row padded to a multiple of ``sequence_parallel`` first, as the split does)."""
        return -(-self.tokens // self.sequence_parallel)

    @property
    def sharded(self) -> bool:
        return self.distributed == "fsdp2"

    @property
    def shards(self) -> int:
        return (self.shard_group or self.world_size) if self.sharded else 1

    def with_(self, **changes: object) -> Setup:
        return replace(self, **changes)


@dataclass(frozen=True)
class Part:
    """One line of the estimate: bytes per rank on the device and in host memory."""

    name: str
    device: float
    host: float = 0.0
    note: str = ""


@dataclass
class Estimate:
    """The parts, the device peak of each phase, and the peak itself (bytes per rank)."""

    shape: ModelShape
    setup: Setup
    parts: list[Part]
    phases: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def host(self) -> float:
        return sum(p.host for p in self.parts)

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class _Params:
    """Parameter counts and bytes: what trains, what is frozen, by kind."""

    trained: float  # bytes of trained parameters (and of their gradients)
    frozen: float  # bytes of frozen parameters
    trained_count: int
    matrices: int  # trained 2-D hidden matrices (Muon's share), count
    largest_matrix: int  # values of the largest trained hidden matrix
    tensors: list[tuple[int, int]]  # (values, bytes per value) of every trained tensor kind
    linear_trained: int  # trained projection weights, count (autocast caches their casts)
    linear_frozen: int  # frozen projection weights, count (autocast saves their casts)
    head_trains: bool


def _params(shape: ModelShape, setup: Setup) -> _Params:
    w = DTYPE_BYTES[setup.weight_dtype]
    h, n = shape.hidden, shape.layers
    head = h if setup.score_head else shape.head_params
    projections = n * shape.layer_linear_params
    vectors = n * 2 * h + h
    lora = setup.lora
    if lora is None:
        tensors = [(shape.linear_params(name), w) for name in LINEARS for _ in range(n)]
        tensors += [(shape.embed_params, w), (head, w), (h, w)] + [(h, w)] * (2 * n)
        total = projections + vectors + shape.embed_params + head
        biggest = max(shape.linear_params(name) for name in LINEARS)
        return _Params(
            trained=total * w,
            frozen=0.0,
            trained_count=total,
            matrices=projections,
            largest_matrix=biggest,
            tensors=[t for t in tensors if t[0]],
            linear_trained=projections + (0 if setup.score_head else head),
            linear_frozen=0,
            head_trains=True,
        )
    adapters = lora.adapter_params(shape)
    saved = lora.saved_params(shape)
    tensors = [
        (lora.r * side, 4)
        for name in lora.targets
        for side in shape.linear_shape(name)
        for _ in range(n)
    ] + [(shape.embed_params, w)] * len(lora.modules_to_save)
    quant = QUANT_BYTES.get(setup.quant_bits or 0, w)
    frozen = projections * quant + (vectors + shape.embed_params + head) * w
    return _Params(
        trained=adapters * 4 + saved * w,
        frozen=frozen,
        trained_count=adapters + saved,
        matrices=adapters,
        largest_matrix=max(v for v, _ in tensors),
        tensors=tensors,
        linear_trained=adapters + (head if lora.trains_head else 0),
        linear_frozen=projections,
        head_trains=lora.trains_head,
    )


def _optimizer_bytes(p: _Params, setup: Setup) -> tuple[float, float, str]:
    """``(states, step temporaries, note)`` for all ranks' share of one copy (not yet sharded)."""
    name = setup.optimizer
    if name in ADAM_LIKE:
        # FSDP2's DTensors on a GPU take the foreach kernels: sqrt(exp_avg_sq) is a whole
        # temporary (plain tensors get the fused kernel; CPU tensors, offloaded ones too, the
        # per-parameter loop).
        foreach = setup.sharded and setup.device == "cuda" and not setup.cpu_offload
        return 2 * p.trained, (p.trained if foreach else 0.0), "AdamW: 2 states"
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        states = sum(
            v * (2 * (1 + 4 / BNB_BLOCK) if v >= BNB_MIN_8BIT else 8) for v, _ in p.tensors
        )
        return states, 0.0, "8-bit AdamW (bitsandbytes)"
    if name == "paged_adamw_32bit":
        return 8.0 * p.trained_count, 0.0, "32-bit paged AdamW"
    if name == "muon":
        per_value = p.trained / max(p.trained_count, 1)
        rest = p.trained_count - p.matrices
        # Newton-Schulz on the largest matrix: bf16 iterate, its Gram and products, fp32 update.
        temp = 10 * p.largest_matrix
        return per_value * (p.matrices + 2 * rest), temp, "Muon momentum + AdamW for the rest"
    if name == "adafactor":
        # Factored second moments (row + column sums) for matrices; no first moment.
        return 4.0 * sum(2 * int(v**0.5) if v > 4096 else v for v, _ in p.tensors), 0.0, "Adafactor"
    return 0.0, 0.0, "SGD: no state"


# --------------------------------------------------------------------------- the estimate


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    """Every part of one rank's memory and the peak of each phase of a step."""
    w = DTYPE_BYTES[setup.weight_dtype]
    mixed = setup.mixed_precision in ("bf16", "fp16")
    num = Numerics.of(w, mixed, setup.sharded, setup.device)
    p = _params(shape, setup)
    parts, step_temp = _state_parts(shape, setup, p)
    notes: list[str] = []
    start_grads, unsharded_grads = _gathered_parts(shape, setup, p, num, parts, notes)
    t = setup.rank_tokens
    one_layer = layer_bytes_per_token(shape, num, setup.lora) * t
    flow = gradient_flow_bytes_per_token(shape, num) * t
    acts = t * activation_bytes_per_token(
        shape, num, checkpointing=setup.checkpointing, head_trains=p.head_trains, lora=setup.lora
    )
    if setup.checkpointing:
        acts_note = "checkpointed: each layer's input + one layer recomputed"
    else:
        acts_note = "every layer kept for backward"
    parts.append(Part("activations", acts, 0.0, acts_note))
    if setup.score_head:
        head = head_bytes(shape, num, 0, fused=True, chunk_rows=1, head_trains=False)
    else:
        head = head_bytes(
            shape, num, t, fused=setup.fused, chunk_rows=setup.chunk_rows, head_trains=p.head_trains
        )
    parts.append(Part("logits", max(head.forward, head.backward), 0.0, head.path))
    if setup.reference == "model":
        ref = (p.frozen if setup.lora else p.trained) / setup.shards
        parts.append(_placed(setup, "reference model", ref, f"frozen copy, {_where(setup)}"))
    sampling = _rollout_part(shape, setup, num, parts)
    if step_temp:
        parts.append(_placed(setup, "optimizer step temporaries", step_temp / setup.shards))

    def dev(name: str) -> float:
        return sum(q.device for q in parts if q.name == name)

    base = sum(dev(k) for k in ("weights", "weights (frozen base)", "weights (adapters)"))
    base += dev("optimizer states") + dev("DDP gradient buckets") + dev("reference model")
    # On CPU the fused head's buffers stay allocated from the first step on.
    buffers = head.workspace if setup.device == "cpu" else 0.0
    base += buffers
    grads = dev("gradients")
    accumulated = grads if setup.grad_accum > 1 and not setup.sharded else 0.0
    gathered = dev("gathered weights")
    backward_start = gathered + dev("bf16 weight copies") + acts + head.backward - buffers
    phases = {
        # The head's backward: every activation kept, the logits' gradients, the head's gradient.
        "backward start": base + backward_start + start_grads + accumulated,
        # The first layer's backward: every gradient, one layer's activations.
        "backward end": base + gathered + grads + one_layer + flow + unsharded_grads,
        "optimizer step": base + grads + dev("optimizer step temporaries"),
    }
    if sampling is not None:
        phases["sampling"] = base + gathered + sampling
    return Estimate(shape, setup, parts, phases, notes)


def _where(setup: Setup) -> str:
    return f"/ {setup.shards} shards" if setup.sharded and setup.shards > 1 else "full copy"


def _placed(setup: Setup, name: str, nbytes: float, note: str = "") -> Part:
    """A part that lives on the device, or in host memory under FSDP2's CPU offload."""
    if setup.sharded and setup.cpu_offload:
        return Part(name, 0.0, nbytes, note)
    return Part(name, nbytes, 0.0, note)


def _state_parts(shape: ModelShape, setup: Setup, p: _Params) -> tuple[list[Part], float]:
    """Weights, gradients, optimizer states and DDP's buckets, and the optimizer step's
    temporaries (all ranks' share, not yet sharded)."""
    s, where = setup.shards, _where(setup)
    parts: list[Part] = []
    if setup.lora is None:
        parts.append(_placed(setup, "weights", p.trained / s, f"{setup.weight_dtype}, {where}"))
    else:
        parts.append(_placed(setup, "weights (frozen base)", p.frozen / s, where))
        parts.append(_placed(setup, "weights (adapters)", p.trained / s, "fp32 LoRA"))
    parts.append(_placed(setup, "gradients", p.trained / s, "of the trained parameters"))
    states, step_temp, opt_note = _optimizer_bytes(p, setup)
    parts.append(_placed(setup, "optimizer states", states / s, opt_note))
    if setup.distributed == "ddp" and setup.world_size > 1:
        parts.append(Part("DDP gradient buckets", p.trained, 0.0, "one more gradient copy"))
    return parts, step_temp


def _gathered_parts(
    shape: ModelShape, setup: Setup, p: _Params, num: Numerics, parts: list[Part], notes: list[str]
) -> tuple[float, float]:
    """FSDP2's gathered weights and unsharded gradients, or autocast's bf16 weight copies,
    appended to ``parts``; returns the gradients already there when backward starts (the LM
    head's, whose backward comes first, and under FSDP2 with accumulation the unsharded ones of
    earlier micro-batches) and FSDP2's unsharded gradients in backward."""
    mixed = setup.mixed_precision in ("bf16", "fp16")
    w, n = DTYPE_BYTES[setup.weight_dtype], shape.layers
    g = 2 if mixed else w  # dtype of FSDP2's gathered copies (and of their gradients)
    start_grads = (g if setup.sharded else w) * shape.head_params if p.head_trains else 0.0
    if not setup.sharded:
        if num.autocast:
            copies = 2 * p.linear_trained + (0 if setup.checkpointing else 2 * p.linear_frozen)
            parts.append(Part("bf16 weight copies", copies, 0.0, "autocast's casts"))
        return start_grads, 0.0
    adapters_per_layer = setup.lora.adapter_params(shape) // n if setup.lora else 0
    kept = 2 if setup.reshard_after_forward else n
    gathered = g * (shape.root_params + kept * (shape.layer_params + adapters_per_layer))
    parts.append(Part("gathered weights", gathered, 0.0, f"root unit + {kept} layers"))
    if setup.lora is None:
        root_trained, layer_trained = shape.root_params, shape.layer_params
    else:
        root_trained, layer_trained = setup.lora.saved_params(shape), adapters_per_layer
    # The root's gradients (head, embedding) until its reduce-scatter ends backward, and the
    # layer being reduced (fp32 copy under mixed precision).
    unsharded_grads = g * root_trained + (g + (4 if mixed else 0)) * layer_trained
    if setup.grad_accum > 1:
        acc = (4 if mixed else w) * p.trained_count
        unsharded_grads += acc
        start_grads += acc
        notes.append(
            "FSDP2 with gradient_accumulation_steps > 1 keeps unsharded gradients between "
            "micro-batches (the reduce-scatter is skipped until the last)"
        )
    parts.append(Part("unsharded gradients", unsharded_grads, 0.0, "FSDP2, in backward"))
    return start_grads, unsharded_grads


def _rollout_part(
    shape: ModelShape, setup: Setup, num: Numerics, parts: list[Part]
) -> float | None:
    """One sampling call's KV cache and the sampler's logits (appended to ``parts``), or None
    for a method that does not generate."""
    if setup.rollout is None:
        return None
    r = setup.rollout
    kv = 2 * shape.layers * shape.kv_width * num.compute * r.sequences * r.length
    gen = 2 * 4 * r.sequences * shape.vocab  # the sampler's fp32 logits and a processed copy
    parts.append(Part("rollout KV cache", kv + gen, 0.0, f"{r.sequences} seqs x {r.length} tokens"))
    return kv + gen


__all__ = ["GIB", "Estimate", "Part", "Rollout", "Setup", "estimate"]
