"""Orthogonal Subspace Fine-Tuning (OSFT): applying it to a model and plugging it into training.

Paper: Nayak et al., "Sculpting Subspaces: Constrained Full Fine-Tuning in LLMs for Continual
Learning", arXiv 2504.07097.

Stage: model level. :func:`apply_osft` picks the target ``nn.Linear`` s (every linear of the
attention and MLP blocks by default) and swaps each for an :class:`~grimoire.model.osft_linear.OSFTLinear`
(frozen top singular subspace, trainable orthogonal remainder; the per-matrix math and its
invariants are documented in :mod:`grimoire.model.osft_linear`); :class:`OSFTState` projects gradients
and factors around each optimizer step; :func:`osft_dense_state_dict` / :func:`unapply_osft`
merge back to plain weights; :class:`OSFTTrainerHook` / :func:`attach_osft` wire it into
:class:`~grimoire.training.trainer.GrimoireTrainer`.

Design decision: ``apply_osft`` leaves parameters that are not OSFT targets (embeddings, norms,
LM head, untargeted linears, biases) as they are. The trainer freezes them unless
``osft_train_non_targets=True``: measured in docs/osft.md, training them next to the constrained
matrices pushes the change into them and forgets more than full fine-tuning does.

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

import sys
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from grimoire.errors import ConfigError, did_you_mean
from grimoire.model.osft_linear import (
    FACTOR_NAMES,
    FROZEN_FACTORS,
    TRAINABLE_FACTORS,
    OSFTLinear,
    check_unfreeze_rank_ratio,
    merge_factors,
    num_frozen_components,
)

_BLOCK_SUFFIXES = ("attention", "mlp")


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
    _check_osft_arguments(model, unfreeze_rank_ratio, upcast_dtype, rank, world_size)
    names = resolve_osft_targets(model, target_modules)
    # resolve_osft_targets returns nn.Linear modules only.
    linears = {n: cast(nn.Linear, model.get_submodule(n)) for n in names}
    problems = [
        f"{n}: weight dtype {linears[n].weight.dtype} is not a float type "
        "(quantized weights cannot be decomposed)"
        for n in names
        if not linears[n].weight.is_floating_point()
    ]
    if problems:
        raise ConfigError(problems, title="invalid OSFT targets")

    state = OSFTState({}, unfreeze_rank_ratio, upcast_dtype)
    for i, name in enumerate(names):
        linear = linears[name]
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


def _check_osft_arguments(
    model: nn.Module,
    unfreeze_rank_ratio: float,
    upcast_dtype: torch.dtype,
    rank: int,
    world_size: int,
) -> None:
    """:func:`apply_osft`'s arguments: the ratio and dtype, a model without LoRA or OSFT
    already, and ``rank``/``world_size`` as ``torch.distributed`` has them."""
    check_unfreeze_rank_ratio(unfreeze_rank_ratio)
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


class OSFTTrainerHook:
    """Plugs OSFT into :class:`~grimoire.training.trainer.GrimoireTrainer` as a step hook.

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
        """Dense weights under the original architecture's keys (loadable by from_pretrained).

        Merged from ``state_dict``'s factors when it holds them (a full state dict, gathered from
        FSDP2 shards on the main process), else from the live modules."""
        dtype = self.state.upcast_dtype
        if not any(k.endswith(".U_l") for k in state_dict):
            return osft_dense_state_dict(self.model, dtype)
        out: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            prefix, _, leaf = key.rpartition(".")
            if prefix in self.state.modules and leaf in FACTOR_NAMES:
                if prefix + ".weight" not in out:
                    factors = [state_dict[f"{prefix}.{n}"].to(dtype) for n in FACTOR_NAMES]
                    merged = merge_factors(*factors)
                    out[prefix + ".weight"] = merged.to(state_dict[f"{prefix}.U_l"].dtype)
                continue
            out[key] = value
        return out


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


__all__ = [
    "FACTOR_NAMES",
    "FROZEN_FACTORS",
    "TRAINABLE_FACTORS",
    "OSFTLinear",
    "OSFTState",
    "OSFTTrainerHook",
    "apply_osft",
    "attach_osft",
    "num_frozen_components",
    "osft_dense_state_dict",
    "resolve_osft_targets",
    "unapply_osft",
]
