"""Duck-typed methods: :func:`as_method` checks an object's core and gives it the defaults.

A method need not subclass :class:`~grimoire.losses.base.GrimoireLoss`: an object that defines
the core (:class:`~grimoire.contract.method.MethodCore`: ``__call__``, ``create_collator`` and
``loss_weight``) is one. :func:`as_method`, which the trainer (first in its set-up) and
the CLI (before any weights load) call once, refuses an object without the core, naming each
missing member (no default can know the loss units a loss is a mean over, so none is guessed),
and wraps one with it in a :class:`MethodAdapter`: each capability the object defines is its
own (read live, so what its ``setup`` sets is seen), each one it leaves out gets
:class:`GrimoireLoss`'s default. That adapter is the one place a method is probed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.batching.budget import default_budget_tokens, truncate_sequences
from grimoire.config.context import TrainingContext
from grimoire.contract.method import (
    CORE_MEMBERS,
    Collator,
    GeneratingMethod,
    Method,
    MethodReference,
    PrecomputableMethod,
)
from grimoire.losses.base import GrimoireLoss, column_problems, holds_module

_ABSENT = object()


def _defined(method: Any, name: str) -> Any:
    """``method.name``, or :data:`_ABSENT` when it has none: the one place a method is probed."""
    return getattr(method, name, _ABSENT)


class MethodAdapter:
    """A duck-typed method seen as a :class:`~grimoire.contract.method.Method` (made by
    :func:`as_method`, which has checked its core).

    The core is the wrapped object's; each capability is its own when it defines it, else
    :class:`GrimoireLoss`'s default. Other attributes (a method's own settings) are read from it
    too.
    """

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    def _own(self, name: str, default: Any) -> Any:
        """The wrapped object's ``name`` when it defines it, else ``default``."""
        value = _defined(self.wrapped, name)
        return default if value is _ABSENT else value

    # ------------------------------------------------------------------ the core, and identity

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, Mapping[str, float | Tensor]]:
        return self.wrapped(model, batch, training=training)

    def create_collator(self, pad_token_id: int) -> Collator:
        return self.wrapped.create_collator(pad_token_id)

    def loss_weight(self, batch: dict[str, Any]) -> float:
        return float(self.wrapped.loss_weight(batch))

    @property
    def method_name(self) -> str:
        return type(self.wrapped).__name__

    @property
    def implementation(self) -> Any:
        return self.wrapped

    # ------------------------------------------------------------------ capabilities

    @property
    def required_columns(self) -> tuple[str, ...]:
        return self._own("required_columns", GrimoireLoss.required_columns)

    @property
    def model_kind(self) -> str:
        return self._own("model_kind", GrimoireLoss.model_kind)

    @property
    def steps_per_batch(self) -> int:
        return self._own("steps_per_batch", GrimoireLoss.steps_per_batch)

    @property
    def needs_generation(self) -> bool:
        return self._own("needs_generation", GrimoireLoss.needs_generation)

    @property
    def fused(self) -> bool:
        return self._own("fused", GrimoireLoss.fused)

    @property
    def fused_chunk_size(self) -> int:
        return self._own("fused_chunk_size", GrimoireLoss.fused_chunk_size)

    @property
    def logp_reduction(self) -> str:
        return self._own("logp_reduction", GrimoireLoss.logp_reduction)

    @property
    def needs_reference_model(self) -> bool:
        return self._own("needs_reference_model", GrimoireLoss.needs_reference_model)

    @property
    def reference(self) -> MethodReference | None:
        return self._own("reference", GrimoireLoss.reference)

    @property
    def holds_reference(self) -> bool:
        return self._own("holds_reference", holds_module(self.reference))

    @property
    def budget_hint(self) -> str:
        return self._own("budget_hint", GrimoireLoss.budget_hint)

    def create_packed_collator(self, pad_token_id: int) -> Collator | None:
        own = _defined(self.wrapped, "create_packed_collator")
        return None if own is _ABSENT else own(pad_token_id)

    def budget_tokens(self, lengths: dict[str, int], packed: bool) -> int:
        return self._own("budget_tokens", default_budget_tokens)(lengths, packed)

    def fit_to_budget(self, row: dict[str, Any], budget: int) -> dict[str, Any]:
        return self._own("fit_to_budget", truncate_sequences)(row, budget)

    def adapt_rows(self, dataset: Any, tokenizer: Any) -> Any:
        own = _defined(self.wrapped, "adapt_rows")
        return dataset if own is _ABSENT else own(dataset, tokenizer)

    def validate_dataset(self, dataset: Any, split: str = "train") -> list[str]:
        own = _defined(self.wrapped, "validate_dataset")
        if own is not _ABSENT:
            return own(dataset, split)
        required = self.required_columns
        return column_problems(
            dataset, split, self.method_name, lambda names: [c for c in required if c not in names]
        )

    def setup(self, ctx: TrainingContext) -> None:
        own = _defined(self.wrapped, "setup")
        if own is not _ABSENT:
            own(ctx)

    def cache_rows(self, dataset: Any) -> Any:
        own = _defined(self.wrapped, "cache_rows")
        return dataset if own is _ABSENT else own(dataset)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the contract does not define (a method's own settings).
        if name == "wrapped":  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


class PrecomputableAdapter(MethodAdapter):
    """A duck-typed method with ``reference_logps(model, batch)``: it scores its own reference
    (:class:`~grimoire.contract.method.ScoresReference`), before training when the reference is
    cacheable (a :class:`~grimoire.contract.method.PrecomputableMethod`)."""

    def reference_logps(self, model: torch.nn.Module, batch: dict[str, Any]) -> Sequence[Tensor]:
        return self.wrapped.reference_logps(model, batch)


class GeneratingAdapter(PrecomputableAdapter):
    """A duck-typed method that generates (``needs_generation``), seen as a
    :class:`~grimoire.contract.method.GeneratingMethod`: it must define ``engine``, ``sampling``
    and ``build_batches(ctx, groups)``, and ``reference_logps(model, batch)`` when it
    ``needs_reference_model``; the rest default to no reward functions, no old log-probs,
    synchronous rollouts (``max_staleness`` 0) and one completion per sample (no ``agent``).

    Raises:
        TypeError: (on construction) the object lacks one of the required members.
    """

    def __init__(self, wrapped: Any):
        super().__init__(wrapped)
        required = ["engine", "sampling", "build_batches"]
        if self.needs_reference_model:
            required.append("reference_logps")
        missing = [n for n in required if _defined(wrapped, n) is _ABSENT]
        if missing:
            raise TypeError(
                f"{self.method_name} sets needs_generation but has no {', '.join(missing)}: a "
                "method that generates defines engine, sampling and build_batches(ctx, groups), "
                "and reference_logps(model, batch) when it needs a reference model (see "
                "grimoire.losses.online.OnlineMethod)"
            )

    @property
    def engine(self) -> Any:
        return self.wrapped.engine

    @property
    def sampling(self) -> Any:
        return self.wrapped.sampling

    @property
    def reward_funcs(self) -> Sequence[Any]:
        return self._own("reward_funcs", ())

    @property
    def needs_old_logps(self) -> bool:
        return self._own("needs_old_logps", False)

    @property
    def max_staleness(self) -> int:
        return self._own("max_staleness", 0)

    @property
    def agent(self) -> Any:
        return self._own("agent", None)

    def build_batches(
        self, ctx: TrainingContext, groups: list[Any]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        return self.wrapped.build_batches(ctx, groups)


def missing_core(obj: Any) -> list[str]:
    """The members of :class:`~grimoire.contract.method.MethodCore` that ``obj`` lacks."""
    return [name for name in CORE_MEMBERS if not callable(_defined(obj, name))]


def as_method(obj: Any) -> Method:
    """``obj`` as a :class:`~grimoire.contract.method.Method`: itself when it is a
    :class:`GrimoireLoss` (or already adapted), else an adapter over it: a
    :class:`GeneratingAdapter` when it generates, a :class:`PrecomputableAdapter` when it has
    ``reference_logps(model, batch)``, else a :class:`MethodAdapter`.

    Raises:
        TypeError: ``obj`` lacks a member of the core; the message names each and how to write
            it.
    """
    if isinstance(obj, (GrimoireLoss, MethodAdapter)):
        return obj
    missing = missing_core(obj)
    if missing:
        raise TypeError(
            f"{type(obj).__name__} is not a training method: it has no {', '.join(missing)}. "
            + " ".join(_CORE_HELP[name] for name in missing)
            + " (docs/custom-loss.md: the contract)"
        )
    if MethodAdapter(obj).needs_generation:
        return GeneratingAdapter(obj)
    if callable(_defined(obj, "reference_logps")):
        return PrecomputableAdapter(obj)
    return MethodAdapter(obj)


#: How to write each core member, for the refusal of an object without it.
_CORE_HELP = {
    "__call__": "Define __call__(model, batch, training=True) returning (loss, metrics): the "
    "micro-batch's loss as a mean over its loss units, and a dict of detached scalars.",
    "create_collator": "Define create_collator(pad_token_id) returning a callable that turns a "
    "list of rows into a batch dict of tensors (e.g. grimoire.losses.SFTCollator).",
    "loss_weight": "Define loss_weight(batch) returning the number of loss units the loss is a "
    "mean over, e.g. `return float(num_targets(batch))` for a mean over trained tokens or "
    "`float(num_rows(batch))` for a mean over rows (both from grimoire.losses): the trainer "
    "weights each micro-batch by it, so that gradient accumulation and several processes "
    "optimise the same objective as one big batch, and no default can know your loss's units.",
}


# The contract each adapter implements, checked by the type checker here.
_ADAPTS: type[Method] = MethodAdapter
_PRECOMPUTES: type[PrecomputableMethod] = PrecomputableAdapter
_GENERATES: type[GeneratingMethod[Any, Any, Any, Any]] = GeneratingAdapter


__all__ = [
    "GeneratingAdapter",
    "MethodAdapter",
    "PrecomputableAdapter",
    "as_method",
    "missing_core",
]
