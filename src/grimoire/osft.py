"""Orthogonal Subspace Fine-Tuning (OSFT).

Paper: Nayak et al., "Sculpting Subspaces: Constrained Full Fine-Tuning in LLMs for Continual
Learning", arXiv 2504.07097.

Each target ``nn.Linear`` weight ``W`` (``[N, M]`` = ``[out_features, in_features]``) is split by
its SVD, computed in ``upcast_dtype``, ``W = U diag(S) V^T`` with ``m = min(N, M)`` components
sorted by singular value::

    W = U_h diag(S_h) V_h^T  +  U_l diag(S_l) V_l^T
        frozen (buffers)        trainable (parameters)
    U_h [N, k], S_h [k], V_h [M, k]      U_l [N, r], S_l [r], V_l [M, r]
    k = floor(m * (1 - R)),  r = m - k,  R = unfreeze_rank_ratio in [0, 1]

The high-singular-value subspace holds what the model already knows and is never updated. The
low part is trained, but only inside the orthogonal complement of the frozen subspaces: gradients
of ``U_l`` / ``V_l`` are projected with ``G <- G - U_h (U_h^T G)`` (``V`` likewise) before the
optimizer step, and the factors themselves are re-projected after it, because Adam's per-element
scaling of a projected gradient is no longer orthogonal to ``U_h``. With ``U_h^T U_l = 0`` and
``V_h^T V_l = 0`` we get ``U_h^T W = diag(S_h) V_h^T`` and ``W V_h = U_h diag(S_h)``: the frozen
singular triplets stay singular triplets of the trained ``W``, exactly.

Design decisions:

* ``apply_osft`` leaves parameters that are not OSFT targets (embeddings, norms, LM head,
  untargeted linears, biases) as they are. The trainer freezes them unless
  ``osft_train_non_targets=True``: measured in docs/osft.md, training them next to the constrained
  matrices pushes the change into them and forgets more than full fine-tuning does.
* ``U_l``, ``S_l``, ``V_l`` are ordinary ``nn.Parameter`` s, so any optimizer works unchanged. We
  do not special-case weight decay: decoupled decay multiplies the low factors by a scalar, which
  keeps them orthogonal to the frozen subspace and shrinks only the trainable part of ``W`` (the
  frozen part is made of buffers and never decays). Exclude them from decay if you prefer.
* Factors are stored in the original weight's dtype and device; SVD, gradient projection and the
  dense merge run in ``upcast_dtype``. In bf16 the stored ``U_h`` is orthonormal only to ~1e-2,
  so the invariance above holds to that precision; ``reproject`` stops the error accumulating.
* Memory: a square layer costs ~2x its dense weight (``U`` and ``V`` are both ``m``-wide), plus
  the dense ``W_eff`` rebuilt transiently in each forward.

Trainer usage::

    state = apply_osft(model, unfreeze_rank_ratio=0.25, rank=rank, world_size=world_size)
    optimizer = AdamW(p for p in model.parameters() if p.requires_grad)
    ...
    loss.backward()
    state.project_gradients()     # after backward, before grad clipping / optimizer.step()
    optimizer.step()
    state.reproject()             # right after optimizer.step()
    ...
    model.save_pretrained(out_dir, state_dict=osft_dense_state_dict(model))   # dense HF model
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from grimoire.errors import ConfigError, did_you_mean

FROZEN_FACTORS = ("U_h", "S_h", "V_h")
TRAINABLE_FACTORS = ("U_l", "S_l", "V_l")
FACTOR_NAMES = FROZEN_FACTORS + TRAINABLE_FACTORS
_BLOCK_SUFFIXES = ("attention", "mlp")


def num_frozen_components(min_dim: int, unfreeze_rank_ratio: float) -> int:
    """Number of frozen singular components ``k = floor(min_dim * (1 - R))``.

    Evaluated in exact rational arithmetic on the ratio's decimal form: in binary floating point
    ``10 * (1 - 0.9) == 0.9999999999999998``, which would floor to 0 instead of 1.
    """
    _check_ratio(unfreeze_rank_ratio)
    return math.floor(min_dim * (1 - Fraction(repr(float(unfreeze_rank_ratio)))))


def _check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError([f"unfreeze_rank_ratio must be a number in [0, 1], got {ratio!r}"])


@contextlib.contextmanager
def _no_autocast(device_type: str) -> Iterator[None]:
    # The dense weight is a sum of m rank-1 terms; rebuilding it in bf16 under autocast would
    # lose far more precision than a bf16 matmul with the finished weight does.
    try:
        ctx = torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # device type without autocast support
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def _remove_component(x: Tensor, basis: Tensor, compute_dtype: torch.dtype) -> Tensor:
    """``x - B (B^T x)`` for an orthonormal ``basis`` B ``[D, k]`` and ``x`` ``[D, r]``."""
    b = basis.to(compute_dtype)
    x_c = x.to(compute_dtype)
    return (x_c - b @ (b.T @ x_c)).to(x.dtype)


class OSFTLinear(nn.Module):
    """Drop-in ``nn.Linear`` with weight ``W_eff = U_h diag(S_h) V_h^T + U_l diag(S_l) V_l^T``.

    ``forward(x) = x @ W_eff^T + bias`` with ``W_eff`` rebuilt (autocast off) in the factors'
    dtype; the matmul with ``x`` follows the ambient autocast like ``nn.Linear``. Shapes:
    ``U_h [N, k]``, ``S_h [k]``, ``V_h [M, k]`` (persistent buffers, so checkpoints restore them);
    ``U_l [N, r]``, ``S_l [r]``, ``V_l [M, r]`` (parameters; ``requires_grad=False`` when r = 0).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_frozen: int,
        bias: nn.Parameter | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        m = min(in_features, out_features)
        if not 0 <= num_frozen <= m:
            raise ValueError(f"num_frozen must be in [0, {m}], got {num_frozen}")
        self.in_features, self.out_features = in_features, out_features
        self.num_frozen, self.num_trainable = num_frozen, m - num_frozen
        k, r = num_frozen, m - num_frozen

        def empty(*shape: int) -> Tensor:
            return torch.empty(*shape, device=device, dtype=dtype)

        self.register_buffer("U_h", empty(out_features, k))
        self.register_buffer("S_h", empty(k))
        self.register_buffer("V_h", empty(in_features, k))
        # Registered even when empty (r = 0) so every R gives the same state_dict layout.
        self.U_l = nn.Parameter(empty(out_features, r), requires_grad=r > 0)
        self.S_l = nn.Parameter(empty(r), requires_grad=r > 0)
        self.V_l = nn.Parameter(empty(in_features, r), requires_grad=r > 0)
        self.bias = bias

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        unfreeze_rank_ratio: float,
        upcast_dtype: torch.dtype = torch.float32,
        svd_device: torch.device | str | None = None,
        decompose: bool = True,
    ) -> OSFTLinear:
        """Wrap ``linear``, reusing its bias Parameter; SVD its weight unless not ``decompose``."""
        w = linear.weight
        k = num_frozen_components(min(w.shape), unfreeze_rank_ratio)
        module = cls(w.shape[1], w.shape[0], k, linear.bias, device=w.device, dtype=w.dtype)
        if decompose:
            module.set_from_weight(w, upcast_dtype, svd_device)
        return module

    @torch.no_grad()
    def set_from_weight(
        self,
        weight: Tensor,
        upcast_dtype: torch.dtype = torch.float32,
        svd_device: torch.device | str | None = None,
    ) -> None:
        """Fill the factors from the SVD of ``weight`` ``[N, M]``, computed in ``upcast_dtype``."""
        w = weight.detach().to(device=svd_device or weight.device, dtype=upcast_dtype)
        u, s, vh = torch.linalg.svd(w, full_matrices=False)  # s sorted in descending order
        v, k = vh.T, self.num_frozen
        for name, value in zip(
            FACTOR_NAMES, (u[:, :k], s[:k], v[:, :k], u[:, k:], s[k:], v[:, k:])
        ):
            target = getattr(self, name)
            target.copy_(value.to(device=target.device, dtype=target.dtype))
        # The SVD's U_l is orthogonal to U_h only up to roundoff; project it once now, exactly as
        # `reproject` will after each step, so the first step does not carry a roundoff "jump".
        self.reproject(upcast_dtype)

    def factors(self) -> dict[str, Tensor]:
        """The six factor tensors by name (live references, not copies)."""
        return {name: getattr(self, name) for name in FACTOR_NAMES}

    def dense_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """``U_h diag(S_h) V_h^T + U_l diag(S_l) V_l^T`` ``[N, M]``, computed in ``dtype``.

        Differentiable w.r.t. the trainable factors; ``dtype`` defaults to the factors' dtype.
        """
        dtype = dtype or self.U_l.dtype
        with _no_autocast(self.U_l.device.type):
            u_h, s_h, v_h = (t.to(dtype) for t in (self.U_h, self.S_h, self.V_h))
            u_l, s_l, v_l = (t.to(dtype) for t in (self.U_l, self.S_l, self.V_l))
            if self.num_trainable == 0:
                return (u_h * s_h) @ v_h.T
            low = (u_l * s_l) @ v_l.T
            return low if self.num_frozen == 0 else torch.addmm(low, u_h * s_h, v_h.T)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dense_weight(), self.bias)

    @torch.no_grad()
    def project_gradients(self, compute_dtype: torch.dtype = torch.float32) -> None:
        """``grad(U_l) -= U_h (U_h^T grad(U_l))`` and likewise for ``V_l``, in place."""
        for low, high in ((self.U_l, self.U_h), (self.V_l, self.V_h)):
            if low.grad is not None and low.numel() and high.numel():
                low.grad.copy_(_remove_component(low.grad, high, compute_dtype))

    @torch.no_grad()
    def reproject(self, compute_dtype: torch.dtype = torch.float32) -> None:
        """``U_l -= U_h (U_h^T U_l)`` and likewise for ``V_l``, in place."""
        for low, high in ((self.U_l, self.U_h), (self.V_l, self.V_h)):
            if low.numel() and high.numel():
                low.copy_(_remove_component(low, high, compute_dtype))

    @torch.no_grad()
    def merged_weight(self, upcast_dtype: torch.dtype = torch.float32) -> Tensor:
        """Dense weight for saving: summed in ``upcast_dtype``, returned in the factors' dtype."""
        return self.dense_weight(upcast_dtype).to(self.U_l.dtype)

    def to_linear(self, upcast_dtype: torch.dtype = torch.float32) -> nn.Linear:
        """A plain ``nn.Linear`` with the merged weight and this module's bias Parameter."""
        # Built on meta so nn.Linear's random init is skipped; real tensors are assigned below.
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(self.merged_weight(upcast_dtype))
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"frozen_rank={self.num_frozen}, trainable_rank={self.num_trainable}, "
            f"bias={self.bias is not None}"
        )


@dataclass
class OSFTState:
    """Handle returned by :func:`apply_osft`.

    Attributes:
        modules: target name -> its :class:`OSFTLinear`, in model order.
        unfreeze_rank_ratio: R used for every target.
        upcast_dtype: dtype of SVD, projections and merges.
        decomposed_locally: targets whose SVD this rank computed (the rest were broadcast).
    """

    modules: dict[str, OSFTLinear]
    unfreeze_rank_ratio: float
    upcast_dtype: torch.dtype = torch.float32
    decomposed_locally: list[str] = field(default_factory=list)

    def project_gradients(self) -> None:
        """Call after ``backward`` and before grad clipping / ``optimizer.step()``."""
        for module in self.modules.values():
            module.project_gradients(self.upcast_dtype)

    def reproject(self) -> None:
        """Call right after ``optimizer.step()``."""
        for module in self.modules.values():
            module.reproject(self.upcast_dtype)

    def trainable_factors(self) -> list[nn.Parameter]:
        """Trainable ``U_l``, ``S_l``, ``V_l`` of every target (empty when R = 0)."""
        return [p for m in self.modules.values() for p in (m.U_l, m.S_l, m.V_l) if p.requires_grad]

    def dense_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """Same as :func:`osft_dense_state_dict`."""
        return osft_dense_state_dict(model, self.upcast_dtype)

    def merge(self, model: nn.Module) -> nn.Module:
        """Same as :func:`unapply_osft` (in place; this handle is stale afterwards)."""
        return unapply_osft(model, self.upcast_dtype)


def _is_lora_model(model: nn.Module) -> bool:
    if hasattr(model, "peft_config"):
        return True
    # Only consult peft when it is already imported: a model cannot hold LoRA layers otherwise,
    # and importing peft (and transformers with it) costs seconds.
    peft = sys.modules.get("peft")
    lora_layer = getattr(getattr(getattr(peft, "tuners", None), "lora", None), "LoraLayer", None)
    return any(
        (lora_layer is not None and isinstance(m, lora_layer))
        or any(c.__name__ == "LoraLayer" for c in type(m).__mro__)
        for m in model.modules()
    )


def _default_targets(model: nn.Module) -> list[str]:
    """Every ``nn.Linear`` inside a module whose class name ends in Attention or MLP."""
    get_out = getattr(model, "get_output_embeddings", None)
    lm_head = get_out() if callable(get_out) else None
    targets: list[str] = []

    def visit(module: nn.Module, prefix: str, inside_block: bool) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, nn.Linear):
                if inside_block and child is not lm_head:
                    targets.append(name)
            elif not isinstance(child, nn.Embedding):
                is_block = type(child).__name__.lower().endswith(_BLOCK_SUFFIXES)
                visit(child, name, inside_block or is_block)

    visit(model, "", False)
    return targets


def resolve_osft_targets(model: nn.Module, target_modules: list[str] | None = None) -> list[str]:
    """Names of the ``nn.Linear`` modules OSFT will replace, in model order.

    ``None`` selects every linear of the attention and MLP blocks, found by module type so it
    works across architectures (embeddings and the LM head are never targets). Otherwise each
    entry is a name suffix (``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``) that must
    match at least one module, and every match must be an ``nn.Linear``.
    """
    if target_modules is None:
        targets = _default_targets(model)
        if not targets:
            raise ConfigError(
                [
                    f"no nn.Linear inside Attention/MLP modules of {type(model).__name__}; "
                    "pass target_modules explicitly"
                ]
            )
        return targets
    if isinstance(target_modules, str):
        raise ConfigError([f"target_modules must be a list of names, got {target_modules!r}"])
    named = dict(model.named_modules())
    problems, targets = [], []
    for suffix in target_modules:
        hits = [n for n in named if n == suffix or n.endswith("." + suffix)]
        leaves = {n.rsplit(".", 1)[-1] for n in named}
        if not hits:
            problems.append(
                f"target module {suffix!r} matches nothing{did_you_mean(suffix, leaves)}"
            )
        for name in hits:
            if not isinstance(named[name], nn.Linear):
                problems.append(f"{name} is a {type(named[name]).__name__}, not an nn.Linear")
            elif name not in targets:
                targets.append(name)
    if problems:
        raise ConfigError(problems, title="invalid OSFT target_modules")
    order = {name: i for i, name in enumerate(named)}
    return sorted(targets, key=order.__getitem__)


def _broadcast_factors(modules: list[OSFTLinear], world_size: int) -> None:
    """Copy each module's factors from the rank that decomposed it (index % world_size)."""
    backend = dist.get_backend()
    for i, module in enumerate(modules):
        for tensor in module.factors().values():
            if tensor.numel() == 0:
                continue
            # NCCL only moves CUDA tensors, but models are usually decomposed on CPU before
            # being sharded; stage through the current GPU in that case.
            staged = tensor.data
            if backend == "nccl" and staged.device.type != "cuda":
                staged = staged.to(torch.device("cuda", torch.cuda.current_device()))
            dist.broadcast(staged, src=i % world_size)
            if staged is not tensor.data:
                tensor.data.copy_(staged)


def apply_osft(
    model: nn.Module,
    unfreeze_rank_ratio: float,
    target_modules: list[str] | None = None,
    upcast_dtype: torch.dtype = torch.float32,
    rank: int = 0,
    world_size: int = 1,
    *,
    svd_device: torch.device | str | None = None,
    decompose: bool = True,
) -> OSFTState:
    """Replace target ``nn.Linear`` s of ``model`` with :class:`OSFTLinear`, in place.

    Args:
        model: a (non-PEFT) model; must not already hold OSFT modules.
        unfreeze_rank_ratio: R in [0, 1]; each target keeps ``floor(min(N, M) * (1 - R))``
            top singular components frozen (R = 1: nothing frozen, R = 0: nothing trainable).
        target_modules: name suffixes, or ``None`` for all attention/MLP linears.
        upcast_dtype: float32 or float64, for SVD, projections and merges.
        rank, world_size: with ``world_size > 1`` (``torch.distributed`` initialized), this rank
            decomposes targets ``i`` with ``i % world_size == rank`` and every target's factors
            are broadcast from its owner, so all ranks end up bitwise identical.
        svd_device: where to run the SVDs (e.g. ``"cuda"`` for a model still on CPU); factors are
            stored back on each weight's device. Default: the weight's device.
        decompose: ``False`` allocates uninitialised factors to be filled by ``load_state_dict``
            when resuming from an OSFT checkpoint (skips the SVDs).

    Returns:
        An :class:`OSFTState` whose ``project_gradients`` / ``reproject`` the trainer calls
        around each ``optimizer.step()``.
    """
    _check_ratio(unfreeze_rank_ratio)
    if upcast_dtype not in (torch.float32, torch.float64):
        raise ConfigError(
            [f"upcast_dtype must be torch.float32 or torch.float64, got {upcast_dtype}"]
        )
    if _is_lora_model(model):
        raise ConfigError(
            [
                "OSFT and LoRA cannot be combined: OSFT trains the low-singular-value subspace of "
                "the full weights, LoRA adds separate adapters; use one or the other"
            ]
        )
    if any(isinstance(m, OSFTLinear) for m in model.modules()):
        raise ConfigError(["apply_osft was already applied to this model"])
    if world_size > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"world_size={world_size} needs torch.distributed initialized")
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise RuntimeError(
                f"rank/world_size {rank}/{world_size} disagree with torch.distributed "
                f"{dist.get_rank()}/{dist.get_world_size()}"
            )
    elif rank != 0 or world_size < 1:
        raise ValueError(f"invalid rank/world_size {rank}/{world_size}")

    names = resolve_osft_targets(model, target_modules)
    problems = [
        f"{n}: weight dtype {model.get_submodule(n).weight.dtype} is not a float type "
        "(quantized weights cannot be decomposed)"
        for n in names
        if not model.get_submodule(n).weight.is_floating_point()
    ]
    if problems:
        raise ConfigError(problems, title="invalid OSFT targets")

    state = OSFTState({}, unfreeze_rank_ratio, upcast_dtype)
    for i, name in enumerate(names):
        linear = model.get_submodule(name)
        mine = decompose and i % world_size == rank
        module = OSFTLinear.from_linear(
            linear, unfreeze_rank_ratio, upcast_dtype, svd_device, decompose=mine
        )
        if mine:
            state.decomposed_locally.append(name)
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, module)
        state.modules[name] = module
    if decompose and world_size > 1:
        _broadcast_factors(list(state.modules.values()), world_size)
    return state


def osft_dense_state_dict(
    model: nn.Module, upcast_dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """``model.state_dict()`` with each OSFT module's factors replaced by its merged ``weight``.

    Keys are the original architecture's (``...q_proj.weight``, ``...q_proj.bias``), so
    ``model.save_pretrained(out_dir, state_dict=osft_dense_state_dict(model))`` writes a dense
    checkpoint that ``from_pretrained`` loads into the plain architecture. The model is not
    modified.
    """
    osft = {n: m for n, m in model.named_modules() if isinstance(m, OSFTLinear)}
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if prefix in osft and leaf in FACTOR_NAMES:
            if prefix + ".weight" not in out:
                out[prefix + ".weight"] = osft[prefix].merged_weight(upcast_dtype)
            continue
        out[key] = value
    return out


def unapply_osft(model: nn.Module, upcast_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Swap every :class:`OSFTLinear` back to an ``nn.Linear`` with the merged weight, in place.

    Deep-copy the model first if training continues; biases are shared, not copied.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, OSFTLinear):
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, module.to_linear(upcast_dtype))
    return model


FACTORS_FILE = "osft_factors.safetensors"


class OSFTTrainerHook:
    """Plugs OSFT into :class:`~grimoire.trainer.GrimoireTrainer` as a step hook.

    The loop calls ``before_optimizer_step`` (gradient projection, before clipping so the
    clipped norm is that of the applied update) and ``after_optimizer_step`` (re-projection);
    saving writes dense HF weights for users plus the exact factors for resuming.
    """

    def __init__(self, model: nn.Module, state: OSFTState):
        self.model = model
        self.state = state

    def before_optimizer_step(self) -> None:
        self.state.project_gradients()

    def after_optimizer_step(self) -> None:
        self.state.reproject()

    def export_state_dict(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Dense weights under the original architecture's keys (loadable by from_pretrained)."""
        del state_dict  # rebuilt from the live modules, which hold the exact factors
        return osft_dense_state_dict(self.model, self.state.upcast_dtype)

    def save_extra(self, folder) -> None:
        from safetensors.torch import save_file

        factors = {
            f"{name}.{k}": v.detach().contiguous().cpu()
            for name, module in self.state.modules.items()
            for k, v in module.factors().items()
        }
        save_file(factors, str(folder / FACTORS_FILE))

    def load_extra(self, model: nn.Module, folder) -> None:
        """Restore a checkpoint: factors from their file, every other weight from the dense one."""
        from safetensors.torch import load_file

        dense: dict[str, Tensor] = {}
        index = folder / "model.safetensors.index.json"
        if index.exists():
            import json

            for f in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                dense.update(load_file(str(folder / f)))
        else:
            dense = load_file(str(folder / "model.safetensors"))
        factors = load_file(str(folder / FACTORS_FILE))
        targets = {f"{name}.weight" for name in self.state.modules}
        merged = {k: v for k, v in dense.items() if k not in targets}
        merged.update(factors)
        result = model.load_state_dict(merged, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("lm_head.weight")]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"OSFT checkpoint {folder} does not match the model: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )


def attach_osft(model: nn.Module, config, accelerator) -> OSFTTrainerHook:
    """Apply OSFT as ``config`` (a TrainingConfig) asks and return the trainer hook."""
    state = apply_osft(
        model,
        config.osft_unfreeze_rank_ratio,
        config.osft_target_modules,
        upcast_dtype=getattr(torch, config.osft_upcast_dtype),
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )
    if not config.osft_train_non_targets:
        # Continual learning: everything outside the targets' low subspaces keeps what it knows
        # (embeddings, LM head, norms, biases); only U_l, S_l, V_l train.
        trainable = {id(p) for p in state.trainable_factors()}
        for p in model.parameters():
            if id(p) not in trainable:
                p.requires_grad_(False)
    return OSFTTrainerHook(model, state)
