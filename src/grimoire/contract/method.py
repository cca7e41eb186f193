"""The method contract: everything the run reads from a training method, declared once, here.

The contract is small at its core and opt-in beyond it. :class:`MethodCore` is what every method
writes: the loss of a micro-batch (``__call__``), its collator (``create_collator``) and the loss
units that loss is a mean over (``loss_weight``), without which the trainer cannot weight
micro-batches exactly across gradient accumulation and processes. :class:`Method` adds the opt-in
capabilities (:data:`CAPABILITIES`), each with one meaning, one signature and a default in
:class:`grimoire.losses.base.GrimoireLoss`: it is what the loop, the loader, the token budget,
the data checks, the reference cache, the memory estimate and the CLI call on a method.
:class:`GeneratingMethod` adds the parts the rollout stage is built from, for methods that sample
their own data (online RL), and :class:`PrecomputableMethod` marks a method whose reference can be
scored before training; both score their reference with the one
:meth:`ScoresReference.reference_logps`. Every stage between (``batching/``, ``forward/``,
``rollout/``) types its method with these, from below, instead of describing it again.

Why Protocols (structural types) and not an abstract base class:

* the defaults live in :class:`grimoire.losses.base.GrimoireLoss`, and they need stages above
  this layer (the token budget's default cost and cut, the frozen
  :class:`~grimoire.forward.reference.Reference`); an abstract class here would have to pull
  those down or give up its defaults;
* the stages only need to *name* the type; a Protocol costs them no import of ``losses/``;
* every capability is a read-only property: the run only reads it, and a method may supply it as
  a class attribute, an attribute set in ``__init__`` or a computed property. A Protocol accepts
  all three; an inherited base class attribute would force one form on every subclass.

``GrimoireLoss`` (and ``OnlineMethod`` for :class:`GeneratingMethod`) conform structurally; each
states it in one line the type checker checks (``_IMPLEMENTS: type[Method] = GrimoireLoss``), so
a member whose signature drifts from the contract is a type error, not a surprise at run time.
A duck-typed object goes through :func:`grimoire.losses.adapter.as_method`, which refuses it when it
lacks a member of :class:`MethodCore` (naming it) and gives it the capabilities' defaults.

The rollout's own types (its engine, reward functions, sampling settings and scored groups) live
in ``rollout/``, above this layer. :class:`GeneratingMethod` is generic over them rather than
copying their interfaces here: the contract says a generating method has an engine, reward
functions and sampling settings and turns scored groups into training batches; the rollout
stage, which calls them, fixes what they are (:data:`grimoire.rollout.stage.RolloutMethod`). A
copy of their interfaces here would be one more description to keep in step with the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

from grimoire.config.context import TrainingContext

#: A collator: a micro-batch's rows -> one batch (a dict of tensors and host values).
Collator = Callable[[list[dict[str, Any]]], dict[str, Any]]


class MethodReference(Protocol):
    """What the run reads of a method's frozen reference policy; the implementation is
    :class:`grimoire.forward.reference.Reference` (in ``forward/``, above this layer)."""

    @property
    def source(self) -> str:
        """Where its log-probs come from (``"model"``, ``"copy"``, ``"adapters"``, ...)."""
        ...

    @property
    def cache_columns(self) -> tuple[str, ...]:
        """The batch columns that hold its cached log-probs (empty: not cacheable)."""
        ...

    @property
    def ref_model(self) -> torch.nn.Module | str | None:
        """The frozen model it scores with, ``"copy"`` before set-up, or None (adapters)."""
        ...

    def release(self) -> None:
        """Drop the model after a precompute pass (cached columns only from then on)."""
        ...


@runtime_checkable
class MethodCore(Protocol):
    """What every training method defines: its loss, its collator, and its loss units.

    The weighting contract (:meth:`loss_weight`): the loss returned by :meth:`__call__` is a mean
    over the batch's loss units (tokens, pairs, ...); the trainer rescales each micro-batch by
    ``weight / total_weight_of_the_optimizer_step`` (summed over ranks), so gradient
    accumulation, token-budget micro-batches and N ranks optimise the same objective as one big
    batch. No default can be right for every loss, so a method without it is refused.
    """

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, Mapping[str, float | Tensor]]:
        """``(loss, metrics)`` of one micro-batch: a scalar mean over its loss units, and
        detached scalars (the same keys on every call and every rank)."""
        ...

    def create_collator(self, pad_token_id: int) -> Collator:
        """The padded collator: a micro-batch's rows -> one batch dict of tensors."""
        ...

    def loss_weight(self, batch: dict[str, Any]) -> float:
        """The loss units in ``batch``, what its loss is a mean over: trained tokens for a token
        mean (``num_targets(batch)``), rows for a row mean (``num_rows(batch)``), pairs, ..."""
        ...


class Method(MethodCore, Protocol):
    """A training method as the run reads it: :class:`MethodCore` and the opt-in capabilities
    (:data:`CAPABILITIES`), each with its default in :class:`grimoire.losses.base.GrimoireLoss`;
    ``method_name`` and ``implementation`` are answered for every method."""

    # ------------------------------------------------------------------ what it is

    @property
    def method_name(self) -> str:
        """The method's name in messages."""
        ...

    @property
    def implementation(self) -> object:
        """The object that holds the method's settings (the method, or the one it adapts)."""
        ...

    @property
    def required_columns(self) -> tuple[str, ...]:
        """Columns a tokenized row must have (checked by :meth:`validate_dataset`)."""
        ...

    @property
    def model_kind(self) -> str:
        """The model head the CLI loads: ``"causal_lm"``, or ``"sequence_classification"``."""
        ...

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps taken on each global batch (GRPO's ``num_iterations``)."""
        ...

    @property
    def needs_generation(self) -> bool:
        """It samples its own data during training; then it is a :class:`GeneratingMethod`."""
        ...

    # ------------------------------------------------------------------ log-probs, reference

    @property
    def fused(self) -> bool:
        """Log-probs use the fused, chunked LM-head path (a reference cache follows it)."""
        ...

    @property
    def fused_chunk_size(self) -> int:
        """Rows the fused LM head pushes through at once (what the memory estimate sizes)."""
        ...

    @property
    def logp_reduction(self) -> str:
        """How a sequence's token log-probs are reduced (``"sum"`` | ``"mean"``) for a cache."""
        ...

    @property
    def needs_reference_model(self) -> bool:
        """It compares with a frozen reference policy (see :attr:`reference`)."""
        ...

    @property
    def reference(self) -> MethodReference | None:
        """That reference; None without one."""
        ...

    @property
    def holds_reference(self) -> bool:
        """It already holds its reference model (a module it was given, e.g. distillation's
        teacher), so the run need not provide one."""
        ...

    # ------------------------------------------------------------------ batches

    def create_packed_collator(self, pad_token_id: int) -> Collator | None:
        """The padding-free collator (one packed row per micro-batch); None: cannot pack."""
        ...

    # ------------------------------------------------------------------ the token budget

    @property
    def budget_hint(self) -> str:
        """Appended to a token-budget error: what else a row costs (KTO's KL row, ...)."""
        ...

    def budget_tokens(self, lengths: dict[str, int], packed: bool) -> int:
        """Tokens a row puts into the largest forward pass it takes part in; ``lengths`` maps
        each of its sequences (``""``, ``"chosen_"``, ...) to its ``*input_ids`` length."""
        ...

    def fit_to_budget(self, row: dict[str, Any], budget: int) -> dict[str, Any]:
        """``row`` cut so that :meth:`budget_tokens` is within ``budget``."""
        ...

    # ------------------------------------------------------------------ set-up

    def adapt_rows(self, dataset: Any, tokenizer: Any) -> Any:
        """The tokenized rows as this method reads them (called once, before any check)."""
        ...

    def validate_dataset(self, dataset: Any, split: str = "train") -> list[str]:
        """Problems with the tokenized ``dataset``, named by row, collected before training."""
        ...

    def setup(self, ctx: TrainingContext) -> None:
        """Called once before training with the method's only view of the run."""
        ...

    def cache_rows(self, dataset: Any) -> Any:
        """The rows as a reference cache holds them (KTO fixes its KL pairs)."""
        ...


#: The members of :class:`MethodCore`, which every method defines.
CORE_MEMBERS: tuple[str, ...] = ("__call__", "create_collator", "loss_weight")
#: The opt-in capabilities of :class:`Method`: a method defines the ones it needs, and
#: :class:`grimoire.losses.base.GrimoireLoss` (or, for a duck type, ``as_method``) gives the others
#: their defaults.
CAPABILITIES: tuple[str, ...] = (
    "required_columns",
    "model_kind",
    "steps_per_batch",
    "needs_generation",
    "fused",
    "fused_chunk_size",
    "logp_reduction",
    "needs_reference_model",
    "reference",
    "holds_reference",
    "create_packed_collator",
    "budget_hint",
    "budget_tokens",
    "fit_to_budget",
    "adapt_rows",
    "validate_dataset",
    "setup",
    "cache_rows",
)


class ScoresReference(Protocol):
    """A method that scores its frozen reference itself: one signature, whether the scores are
    cached before training (:class:`PrecomputableMethod`) or taken during it by the rollout stage
    (:class:`GeneratingMethod`)."""

    def reference_logps(self, model: torch.nn.Module, batch: dict[str, Any]) -> Sequence[Tensor]:
        """The reference's log-probs of ``batch``, one tensor per column the loss reads them
        from: ``reference.cache_columns`` when cacheable (DPO: chosen and rejected, ``[rows]``
        each), a generating method's one ``ref_logps`` (``[N, C]``, its completions' tokens,
        masked). ``model`` is the policy being trained (a LoRA reference is it with the
        adapters off). Called only when :attr:`Method.needs_reference_model`."""
        ...


#: What a generating method's engine, reward functions and sampling settings are, and the
#: groups it builds batches from: fixed by the rollout stage (see the module docstring).
EngineT = TypeVar("EngineT", covariant=True)
RewardT = TypeVar("RewardT", covariant=True)
SamplingT = TypeVar("SamplingT", covariant=True)
GroupT = TypeVar("GroupT")


@runtime_checkable
class GeneratingMethod(Method, ScoresReference, Protocol[EngineT, RewardT, SamplingT, GroupT]):
    """A method that samples its own data: the parts its rollout stage is built from.

    The trainer owns the stage (``grimoire.training.setup.build_rollouts``); the stage samples
    with :attr:`engine`, scores with :attr:`reward_funcs`, and hands the step's scored groups to
    :meth:`build_batches`; with a reference, it scores each group's completions with
    :meth:`~ScoresReference.reference_logps`. The stage never holds the method.
    """

    @property
    def engine(self) -> EngineT:
        """What samples the completions."""
        ...

    @property
    def reward_funcs(self) -> Sequence[RewardT]:
        """What scores them."""
        ...

    @property
    def sampling(self) -> SamplingT:
        """How many completions per prompt, and how they are sampled."""
        ...

    @property
    def needs_old_logps(self) -> bool:
        """Rollouts record the sampling policy's log-probs (an extra no-grad forward)."""
        ...

    @property
    def max_staleness(self) -> int:
        """How many optimizer steps old the weights that sampled a step's rollouts may be (0:
        each step samples with its own weights)."""
        ...

    @property
    def agent(self) -> Any:
        """How to play multi-turn episodes (``grimoire.rollout.agents.agent.Agent``), or None:
        one completion per sample."""
        ...

    def build_batches(
        self, ctx: TrainingContext, groups: list[GroupT]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """The step's scored groups as training micro-batches (one per group), and the
        method's rollout metrics. Every rank calls it at the same point of the step."""
        ...


#: The members a :class:`GeneratingMethod` adds to :class:`Method` (with ``reference_logps``).
GENERATING_MEMBERS: tuple[str, ...] = (
    "engine",
    "reward_funcs",
    "sampling",
    "needs_old_logps",
    "max_staleness",
    "agent",
    "build_batches",
    "reference_logps",
)


@runtime_checkable
class PrecomputableMethod(Method, ScoresReference, Protocol):
    """A method whose reference log-probs can be scored before training (DPO, IPO, KTO):
    :attr:`reference` names the cached columns (``reference.cache_columns``), and
    :meth:`~ScoresReference.reference_logps` returns one tensor per column, in that order."""


def generating(method: Method) -> GeneratingMethod[Any, Any, Any, Any] | None:
    """``method`` as a :class:`GeneratingMethod` when it samples its own data
    (:attr:`Method.needs_generation`), else None.

    Raises:
        TypeError: it says it generates but lacks a member of :class:`GeneratingMethod`.
    """
    if not method.needs_generation:
        return None
    if not isinstance(method, GeneratingMethod):
        raise TypeError(
            f"{method.method_name} sets needs_generation but is not a GeneratingMethod: a "
            f"method that generates needs {', '.join(GENERATING_MEMBERS)} (see "
            "grimoire.losses.online.OnlineMethod)"
        )
    return method


__all__ = [
    "CAPABILITIES",
    "CORE_MEMBERS",
    "GENERATING_MEMBERS",
    "Collator",
    "GeneratingMethod",
    "Method",
    "MethodCore",
    "MethodReference",
    "PrecomputableMethod",
    "ScoresReference",
    "generating",
]
