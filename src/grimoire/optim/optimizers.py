"""Optimizers, parameter groups and learning-rate schedules."""

from __future__ import annotations

import math
from typing import Any

import torch

from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError


def _is_norm(module: torch.nn.Module) -> bool:
    # Catches nn.LayerNorm / GroupNorm and every architecture's own RMSNorm class (LlamaRMSNorm,
    # Gemma2RMSNorm, ...), which are not subclasses of any torch norm type.
    return isinstance(module, torch.nn.modules.normalization.LayerNorm | torch.nn.GroupNorm) or (
        "norm" in type(module).__name__.lower()
    )


def no_decay_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters exempt from weight decay: biases and every norm layer's weights."""
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if _is_norm(module) or p_name == "bias" or p_name.endswith("_bias"):
                names.add(full)
    return names


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices/embeddings, and undecayed biases + norm weights."""
    skip = no_decay_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _embedding_param_ids(model: torch.nn.Module) -> set[int]:
    """Ids of the input / output embedding weights (tied or not) and of every nn.Embedding."""
    ids: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if callable(fn) else None
        except (AttributeError, NotImplementedError):  # some wrappers raise instead of None
            module = None
        if isinstance(module, torch.nn.Module):
            ids.update(id(p) for p in module.parameters())
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            ids.update(id(p) for p in module.parameters())
    return ids


def muon_param_groups(model: torch.nn.Module, weight_decay: float) -> tuple[list[dict], list[dict]]:
    """``(muon_groups, adamw_groups)``: every trainable parameter in exactly one group.

    Muon gets the 2-D hidden weight matrices (attention / MLP projections, LoRA factors); the
    input embeddings, the LM head (tied or not: the same tensor is never listed twice), other
    embeddings, norms and biases go to AdamW, split by weight decay as :func:`param_groups`.
    Muon orthogonalises a matrix-shaped update, which is meaningless for a lookup table
    (embeddings: each row is updated only when its token occurs) and for the head's logit scale,
    so Keller Jordan's recipe keeps those on AdamW too.
    """
    skip = no_decay_names(model)
    embeddings = _embedding_param_ids(model)
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():  # named_parameters yields a tied tensor once
        if not p.requires_grad:
            continue
        if name in skip:
            no_decay.append(p)
        elif p.ndim == 2 and id(p) not in embeddings:
            muon.append(p)
        else:
            decay.append(p)
    muon_groups = [{"params": muon, "weight_decay": weight_decay}] if muon else []
    adamw_groups = [
        g
        for g in (
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        )
        if g["params"]
    ]
    return muon_groups, adamw_groups


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer object over a :class:`torch.optim.Muon` and a :class:`torch.optim.AdamW`.

    ``torch.optim.Muon`` refuses any parameter that is not 2-D, so the two halves need two
    optimizers; this class makes them one for the trainer, the LR scheduler and checkpoints.
    ``param_groups`` is the Muon groups followed by the AdamW groups (the very dicts the inner
    optimizers read, so a scheduler that scales ``group["lr"]`` drives both, each from its own
    initial lr), and ``state`` is one mapping shared by both, so the inherited ``state_dict`` /
    ``load_state_dict`` (and DCP's ``get_state_dict``) see a single ordinary optimizer.
    """

    def __init__(
        self,
        muon_groups: list[dict],
        adamw_groups: list[dict],
        *,
        muon_kwargs: dict[str, Any],
        adamw_kwargs: dict[str, Any],
    ):
        if not muon_groups or not adamw_groups:
            raise ConfigError(
                [
                    "optimizer='muon' needs both 2-D hidden weight matrices (for Muon) and other "
                    "trainable parameters (for AdamW); this model has "
                    f"{'no 2-D hidden matrices' if not muon_groups else 'only 2-D hidden matrices'}"
                    ": use optimizer='adamw'"
                ]
            )
        self._muon = torch.optim.Muon(muon_groups, **muon_kwargs)
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw_kwargs)
        super().__init__([*self._muon.param_groups, *self._adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        n = len(self._muon.param_groups)
        self._muon.param_groups = self.param_groups[:n]
        self._adamw.param_groups = self.param_groups[n:]
        self._muon.state = self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(_is_dtensor(p) for g in self._muon.param_groups for p in g["params"]):
            self._sharded_muon_step()
        else:
            self._muon.step()
        self._adamw.step()
        return loss

    def _sharded_muon_step(self) -> None:
        """``torch.optim.Muon``'s step for FSDP2 shards: Newton-Schulz needs the whole matrix.

        Per matrix, one at a time: the momentum update is computed on the local shards, gathered
        (``full_tensor``: one all-gather of one matrix, never the whole model), orthogonalised
        on every process, and each process applies its own slice of the result to its shard. The
        momentum buffer stays sharded, so the state and checkpoints are those of the plain step.
        """
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        for group in self._muon.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                sharded = isinstance(update, DTensor)
                full = update.full_tensor() if sharded else update
                ortho = _zeropower_via_newtonschulz(
                    full, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                if sharded:  # this process's slice of the whole result: no communication
                    ortho = distribute_tensor(
                        ortho, p.device_mesh, p.placements, src_data_rank=None
                    )
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The base class rebuilds param_groups and state as new objects: re-point both halves.
        super().load_state_dict(state_dict)
        self._link()


def _is_dtensor(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _fusable(groups: list[dict]) -> bool:
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") and not _is_dtensor(p)
        for p in params
    )


def build_optimizer(model: torch.nn.Module, config: TrainingConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` over ``param_groups(model)``.

    ``"muon"``: :class:`MuonWithAdamW` over :func:`muon_param_groups` (Muon at
    ``muon_learning_rate`` / ``muon_momentum``, AdamW at ``learning_rate``).
    """
    if config.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise ConfigError(
                [
                    f"optimizer='muon' needs torch >= 2.9 (torch.optim.Muon); found {torch.__version__}"
                ]
            )
        muon_groups, adamw_groups = muon_param_groups(model, config.weight_decay)
        return MuonWithAdamW(
            muon_groups,
            adamw_groups,
            muon_kwargs={"lr": config.muon_learning_rate, "momentum": config.muon_momentum},
            adamw_kwargs={
                "lr": config.learning_rate,
                "betas": (config.adam_beta1, config.adam_beta2),
                "eps": config.adam_epsilon,
            },
        )
    groups = param_groups(model, config.weight_decay)
    lr, betas, eps = (
        config.learning_rate,
        (config.adam_beta1, config.adam_beta2),
        config.adam_epsilon,
    )
    name = config.optimizer
    if name in ("adamw", "adamw_torch", "adamw_hf"):
        # The fused kernel is ~10x the for-loop on a small model's step (docs/performance.md);
        # it takes plain CPU/CUDA float tensors only, not FSDP2's DTensor shards.
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=_fusable(groups))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # Fixed learning rate driven by our scheduler, not Adafactor's relative step sizes.
        return Adafactor(
            groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False
        )
    if name in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"):
        try:
            import bitsandbytes as bnb
        except ImportError as exc:
            raise ConfigError(
                [f"optimizer={name!r} needs bitsandbytes: pip install 'grimoire[quantization]'"]
            ) from exc
        cls = {
            "adamw_8bit": bnb.optim.AdamW8bit,
            "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
            "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
        }[name]
        return cls(groups, lr=lr, betas=betas, eps=eps)
    raise ConfigError([f"unknown optimizer {name!r}"])  # unreachable after config validation


def num_warmup_steps(config: TrainingConfig, total_steps: int) -> int:
    """``warmup_steps`` when > 0, else ``ceil(warmup_ratio * total_steps)``."""
    if config.warmup_steps > 0:
        return config.warmup_steps
    return math.ceil(config.warmup_ratio * total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainingConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """linear / cosine decay to 0 after linear warmup; constant (no warmup); constant_with_warmup."""
    warmup = num_warmup_steps(config, total_steps) if config.lr_scheduler != "constant" else 0
    kind = config.lr_scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)  # never exactly 0: the first step already moves
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        progress = min(progress, 1.0)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def scale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiply every gradient by ``factor`` (a host number) in place (DTensor shards included)."""
    if factor == 1.0:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        # One fused kernel for all of them; torch exposes it only under this private name.
        torch._foreach_mul_(grads, factor)  # pyright: ignore[reportPrivateImportUsage]


def clip_gradients(
    model: torch.nn.Module, accelerator: Any, max_norm: float | None
) -> torch.Tensor | float:
    """Clip to ``max_norm`` (None: measure only); returns the total norm before clipping, as the
    device scalar it was computed as (a float where the engine gives one, nan for none): reading
    it here would be a host sync, so the caller reads it with the step's other numbers. Clipping
    itself reads nothing back (the clip factor is applied on the device)."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = accelerator.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if norm is None:
        return float("nan")
    if hasattr(norm, "full_tensor"):  # a DTensor when the gradients are sharded
        norm = norm.full_tensor()
    return norm.detach().float() if isinstance(norm, torch.Tensor) else float(norm)
