"""The method contract's implementation: :class:`GrimoireLoss`, and :func:`as_method` for duck types.

The contract itself, what the run reads from a method, is declared once at the bottom of the
layers (:mod:`grimoire.contract.method`: :class:`~grimoire.contract.method.Method`, and
:class:`~grimoire.contract.method.GeneratingMethod` for methods that sample their own data).
:class:`GrimoireLoss` implements it with a default for every member; behaviour that differs
between methods (reference models, generation, how a micro-batch is weighted) lives in these
members, never as branches in the loop. The callers call them directly, never probing.

The documented duck-typed protocol (any object with ``__call__`` and ``create_collator``) still
works: :func:`as_method` wraps such an object in a :class:`MethodAdapter` that forwards what the
object defines and supplies the defaults otherwise (a :class:`GeneratingAdapter` for one that
generates). The trainer calls it once, at set-up.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.batching.budget import default_budget_tokens, truncate_sequences
from grimoire.columns import columns_of
from grimoire.config.context import TrainingContext
from grimoire.contract.layout import num_rows
from grimoire.contract.method import (
    Collator,
    GeneratingMethod,
    Method,
    PrecomputableMethod,
)
from grimoire.forward.reference import Reference


class GrimoireLoss(abc.ABC):
    """The base of every training method: :class:`~grimoire.contract.method.Method` (the
    contract, documented there) with a default for each member.

    Required: :meth:`__call__` (the loss of one micro-batch) and :meth:`create_collator`. Every
    other member has a default below; override what the method needs. A method that generates
    is a :class:`~grimoire.contract.method.GeneratingMethod` too
    (:class:`grimoire.losses.online.OnlineMethod`): the members its rollout stage is built from
    are not here, so an offline method carries none of them.
    """

    # ------------------------------------------------------------------ capabilities
    # Class attributes; a subclass overrides them by assignment, in __init__ or as a property.

    #: Columns a tokenized example must have (checked by :meth:`validate_dataset`).
    required_columns: tuple[str, ...] = ()
    #: Needs a frozen reference policy (DPO, IPO, KTO, online methods with KL): see ``reference``.
    needs_reference_model: bool = False
    #: Generates completions from the current policy during training (online RL); such a method
    #: is a GeneratingMethod, whose parts the trainer builds its rollout stage from.
    needs_generation: bool = False
    #: Optimizer steps taken on each global batch (GRPO's num_iterations); read by the planner.
    steps_per_batch: int = 1
    #: The model head the CLI loads: ``"causal_lm"``, or ``"sequence_classification"`` (reward).
    model_kind: str = "causal_lm"
    #: Whether log-probs use the fused chunked LM-head path (the CLI's reference cache follows it).
    fused: bool = True
    #: Rows the fused LM head pushes through at once (``compute_token_logps``' ``chunk_size``).
    fused_chunk_size: int = 1024
    #: How a sequence's token log-probs are reduced (``"sum"`` | ``"mean"``) for a reference cache.
    logp_reduction: str = "sum"
    #: Appended to a token-budget error: what else a row costs (KTO's KL row, a prompt's group).
    budget_hint: str = ""
    #: The frozen reference (:class:`~grimoire.forward.reference.Reference`); None without one.
    reference: Reference | None = None

    # ------------------------------------------------------------------ required

    @abc.abstractmethod
    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, Mapping[str, float | Tensor]]:
        """``(loss, metrics)`` of one micro-batch: a scalar mean over its loss units, and
        detached scalars."""

    @abc.abstractmethod
    def create_collator(self, pad_token_id: int) -> Collator:
        """The padded collator: a list of rows -> a batch dict of tensors."""

    # ------------------------------------------------------------------ hooks with defaults

    @property
    def method_name(self) -> str:
        """The method's name in messages (its class name)."""
        return type(self).__name__

    @property
    def implementation(self) -> Any:
        """The object that holds the method's settings (itself; the wrapped one for an adapter)."""
        return self

    @property
    def holds_reference(self) -> bool:
        """Whether :attr:`reference` already holds its model (given as a module, e.g.
        distillation's teacher), so the run need not provide one."""
        reference = self.reference
        return reference is not None and isinstance(reference.ref_model, torch.nn.Module)

    def create_packed_collator(self, pad_token_id: int) -> Collator | None:
        """Padding-free collator (one packed row per micro-batch), or None when unsupported."""
        return None

    def loss_weight(self, batch: dict[str, Any]) -> float:
        """Loss units in ``batch``; default: one per sample (samples equally weighted): the
        rows of a padded batch, the samples of a packed row."""
        return float(num_rows(batch))

    def budget_tokens(self, lengths: dict[str, int], packed: bool) -> int:
        """Tokens a row puts into the largest forward pass it takes part in under
        ``max_tokens_per_device``; ``lengths`` maps each of its sequences (``""``,
        ``"chosen_"``, ...) to its ``*input_ids`` length. Override when the method adds tokens
        the row does not hold (KTO's KL rows, online completions)."""
        return default_budget_tokens(lengths, packed)

    def fit_to_budget(self, row: dict[str, Any], budget: int) -> dict[str, Any]:
        """``row`` cut so that :meth:`budget_tokens` is within ``budget`` (opt-in truncation)."""
        return truncate_sequences(row, budget)

    def setup(self, ctx: TrainingContext) -> None:
        """Called once before training with a :class:`~grimoire.config.context.TrainingContext`
        (config, accelerator, tokenizer, the unwrapped policy, datasets, collectives): place a
        reference, make a rollout stage, read options. It is the method's only view of the run."""
        return None  # optional hook: most methods need no set-up

    def validate_dataset(self, dataset: Any, split: str = "train") -> list[str]:
        """Problems with the tokenized ``dataset``, named by row, collected before training;
        default: missing :attr:`required_columns`."""
        names = set(columns_of(dataset))
        missing = self._missing_columns(names)
        if missing:
            return [
                f"{split} dataset: missing column(s) {missing} needed by {self.method_name}; "
                f"it has {sorted(names)} (tokenize it with the matching grimoire.data function)"
            ]
        return []

    def _missing_columns(self, names: set[str]) -> list[str]:
        """The :attr:`required_columns` not among ``names`` (a method that reads a column under
        another name too overrides this)."""
        return [c for c in self.required_columns if c not in names]

    def cache_rows(self, dataset: Any) -> Any:
        """The rows as a reference cache holds them (KTO fixes its KL pairs); default: as is."""
        return dataset

    def adapt_rows(self, dataset: Any, tokenizer: Any) -> Any:
        """The tokenized rows as this method reads them, called once by the trainer before any
        check (the online methods read grimoire-rl's prompt columns); default: as is."""
        return dataset


class TokenLogpsLoss(GrimoireLoss):
    """A method whose forward passes are per-token log-probs from
    :func:`grimoire.forward.logprobs.compute_token_logps` (SFT, the pairwise losses, KTO).

    Args:
        fused, fused_chunk_size: passed to it as ``fused`` and ``chunk_size`` (the memory-lean
            chunked LM-head path, and the rows it pushes through the head at once; > 0).
    """

    def __init__(self, fused: bool = True, fused_chunk_size: int = 1024):
        if fused_chunk_size <= 0:
            raise ValueError(f"fused_chunk_size must be > 0, got {fused_chunk_size}")
        self.fused = fused
        self.fused_chunk_size = fused_chunk_size


#: Contract members an adapter reads from the wrapped object when it defines them (the rest of
#: :class:`~grimoire.contract.method.Method`: the call, ``create_collator``, ``method_name`` and
#: ``implementation``, the adapter answers itself).
FORWARDED: tuple[str, ...] = (
    "required_columns",
    "needs_reference_model",
    "needs_generation",
    "steps_per_batch",
    "model_kind",
    "fused",
    "fused_chunk_size",
    "logp_reduction",
    "budget_hint",
    "reference",
    "holds_reference",
    "create_packed_collator",
    "loss_weight",
    "budget_tokens",
    "fit_to_budget",
    "setup",
    "validate_dataset",
    "cache_rows",
    "adapt_rows",
)

_ABSENT = object()


def _defined(method: Any, name: str) -> Any:
    """``method.name``, or :data:`_ABSENT` when it has none: the one place a method is probed."""
    return getattr(method, name, _ABSENT)


class MethodAdapter(GrimoireLoss):
    """A duck-typed method seen through the contract (made by :func:`as_method`).

    Each member of :data:`FORWARDED` is read live from ``wrapped`` when it defines it; otherwise
    the default is the one the trainer always gave such objects: every micro-batch weighs 1 (no
    ``loss_weight``), no dataset checks (no ``validate_dataset``), and :class:`GrimoireLoss`'s
    defaults for the rest. Other attributes are read from ``wrapped`` too.
    """

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, Mapping[str, float | Tensor]]:
        return self.wrapped(model, batch, training=training)

    def create_collator(self, pad_token_id: int) -> Collator:
        return self.wrapped.create_collator(pad_token_id)

    @property
    def method_name(self) -> str:
        return type(self.wrapped).__name__

    @property
    def implementation(self) -> Any:
        return self.wrapped

    def loss_weight(self, batch: dict[str, Any]) -> float:
        return 1.0

    def validate_dataset(self, dataset: Any, split: str = "train") -> list[str]:
        return []

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the contract does not define (a method's own settings).
        if name == "wrapped":  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


class PrecomputableAdapter(MethodAdapter):
    """A duck-typed method with ``reference_logps(model, batch)``: a
    :class:`~grimoire.contract.method.PrecomputableMethod` (its reference can be cached)."""

    def reference_logps(self, model: torch.nn.Module, batch: dict[str, Any]) -> Sequence[Tensor]:
        return self.wrapped.reference_logps(model, batch)


class GeneratingAdapter(MethodAdapter):
    """A duck-typed method that generates (``needs_generation``), seen as a
    :class:`~grimoire.contract.method.GeneratingMethod`: it must define ``engine``, ``sampling``
    and ``build_batches(ctx, groups)``; the other members default to no reward functions, no
    old log-probs, synchronous rollouts (``max_staleness`` 0) and no ``reference_logps(batch)``
    (a method without a reference).

    Raises:
        TypeError: (on construction) the object lacks one of the required members.
    """

    # Read live from the wrapped object (the properties are installed below); declared here for
    # the type checker.
    engine: Any
    sampling: Any
    reward_funcs: Sequence[Any]
    needs_old_logps: bool
    max_staleness: int
    agent: Any

    def __init__(self, wrapped: Any):
        super().__init__(wrapped)
        missing = [n for n in _GENERATING_REQUIRED if _defined(wrapped, n) is _ABSENT]
        if missing:
            raise TypeError(
                f"{self.method_name} sets needs_generation but has no {', '.join(missing)}: a "
                "method that generates defines engine, sampling and build_batches(ctx, groups) "
                "(see grimoire.losses.online.OnlineMethod)"
            )

    def build_batches(
        self, ctx: TrainingContext, groups: list[Any]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        return self.wrapped.build_batches(ctx, groups)

    def reference_logps(self, batch: dict[str, Any]) -> Tensor:
        score = _defined(self.wrapped, "reference_logps")
        if score is _ABSENT:
            raise NotImplementedError(
                f"{self.method_name} needs a reference model but defines no reference_logps(batch)"
            )
        return score(batch)


#: The :class:`GeneratingAdapter` members a duck type that generates must define.
_GENERATING_REQUIRED = ("engine", "sampling", "build_batches")
#: The defaults of the members it may leave out.
_GENERATING_DEFAULTS: dict[str, Any] = {
    "reward_funcs": (),
    "needs_old_logps": False,
    "max_staleness": 0,
    "agent": None,
}


def _forwarding(name: str, default: Any) -> property:
    """A property reading ``name`` from the wrapped object, else ``default`` (a function or
    property default is bound to the adapter)."""

    def read(self: MethodAdapter) -> Any:
        value = _defined(self.wrapped, name)
        if value is not _ABSENT:
            return value
        if inspect.isfunction(default) or isinstance(default, property):
            return default.__get__(self, type(self))
        return default

    return property(read, doc=f"``{name}`` of the wrapped object, or the contract's default.")


for _name in FORWARDED:
    setattr(MethodAdapter, _name, _forwarding(_name, inspect.getattr_static(MethodAdapter, _name)))
for _name in ("engine", "sampling", *_GENERATING_DEFAULTS):
    setattr(GeneratingAdapter, _name, _forwarding(_name, _GENERATING_DEFAULTS.get(_name)))


def as_method(obj: Any) -> GrimoireLoss:
    """``obj`` as a :class:`GrimoireLoss`: itself when it is one, else an adapter over it (for
    the duck-typed protocol: an object with ``__call__`` and ``create_collator``): a
    :class:`GeneratingAdapter` when it generates, a :class:`PrecomputableAdapter` when it has
    ``reference_logps(model, batch)``, else a :class:`MethodAdapter`."""
    if isinstance(obj, GrimoireLoss):
        return obj
    if MethodAdapter(obj).needs_generation:
        return GeneratingAdapter(obj)
    if callable(_defined(obj, "reference_logps")):
        return PrecomputableAdapter(obj)
    return MethodAdapter(obj)


# The contract each class implements, checked by the type checker here (structurally: the
# Protocols' members are read-only properties, which attributes and properties both satisfy).
_IMPLEMENTS: type[Method] = GrimoireLoss
_PRECOMPUTES: type[PrecomputableMethod] = PrecomputableAdapter
_GENERATES: type[GeneratingMethod[Any, Any, Any, Any]] = GeneratingAdapter


__all__ = [
    "FORWARDED",
    "GeneratingAdapter",
    "GrimoireLoss",
    "MethodAdapter",
    "PrecomputableAdapter",
    "TokenLogpsLoss",
    "as_method",
]
