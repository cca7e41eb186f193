"""The method contract: :class:`GrimoireLoss`, and :func:`as_method` for duck-typed methods.

A method is ``method(model, batch, training) -> (loss, metrics)`` plus a collator and a set of
capabilities. Everything the run reads from a method (the loop, the loader, the token budget,
the reference cache, the CLI) is declared here ONCE, with its default and what it means; the
callers then call it directly, never probing. Behaviour that differs between methods (reference
models, generation, how a micro-batch is weighted) lives in these members, never as branches in
the loop.

The documented duck-typed protocol (any object with ``__call__`` and ``create_collator``) still
works: :func:`as_method` wraps such an object in a :class:`MethodAdapter` that forwards what the
object defines and supplies the defaults otherwise. The trainer calls it once, at set-up.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.batching.budget import default_budget_tokens, truncate_sequences
from grimoire.columns import columns_of
from grimoire.contract.layout import num_rows
from grimoire.forward.reference import Reference
from grimoire.rollout.engine import RolloutEngine
from grimoire.rollout.rewards import RewardFunction
from grimoire.rollout.stage import SamplingConfig, ScoredGroup


class GrimoireLoss(abc.ABC):
    """The one contract between a training method and the run.

    Required: :meth:`__call__` (the loss of one micro-batch) and :meth:`create_collator`. Every
    other member has a default below; override what the method needs.

    The weighting contract (:meth:`loss_weight`): the loss returned by ``__call__`` is a mean
    over the batch's loss units (tokens, pairs, ...); the trainer rescales each micro-batch by
    ``weight / total_weight_of_the_optimizer_step`` (summed over ranks), so gradient
    accumulation, token-budget micro-batches and N ranks optimise the same objective as one big
    batch.
    """

    # ------------------------------------------------------------------ capabilities
    # Class attributes; a subclass overrides them by assignment, in __init__ or as a property.

    #: Columns a tokenized example must have (checked by :meth:`validate_dataset`).
    required_columns: tuple[str, ...] = ()
    #: Needs a frozen reference policy (DPO, IPO, KTO, online methods with KL): see ``reference``.
    needs_reference_model: bool = False
    #: Generates completions from the current policy during training (online RL): the trainer
    #: then builds its rollout stage from ``engine``, ``reward_funcs``, ``sampling``,
    #: :meth:`build_batches`, ``needs_old_logps`` and ``reference_logps``.
    needs_generation: bool = False
    #: Optimizer steps taken on each global batch (GRPO's num_iterations); read by the planner.
    steps_per_batch: int = 1
    #: The model head the CLI loads: ``"causal_lm"``, or ``"sequence_classification"`` (reward).
    model_kind: str = "causal_lm"
    #: Whether log-probs use the fused chunked LM-head path (the CLI's reference cache follows it).
    fused: bool = True
    #: How a sequence's token log-probs are reduced (``"sum"`` | ``"mean"``) for a reference cache.
    logp_reduction: str = "sum"
    #: Appended to a token-budget error: what else a row costs (KTO's KL row, a prompt's group).
    budget_hint: str = ""
    #: The frozen reference (:class:`~grimoire.forward.reference.Reference`); None without one.
    reference: Reference | None = None
    #: Methods that generate: the engine that samples, the reward functions that score, and the
    #: sampling settings (G, temperature, ...). The trainer owns the stage made from them.
    engine: RolloutEngine | None = None
    reward_funcs: Sequence[RewardFunction] = ()
    sampling: SamplingConfig | None = None
    #: Whether rollouts record the sampling policy's log-probs (an extra no-grad forward).
    needs_old_logps: bool = False
    #: ``reference_logps(model, batch)``: the cached reference columns of a batch, for methods
    #: whose reference can be computed before training (``precompute_ref_log_probs``); None: not.
    reference_logps: Callable[..., Any] | None = None

    # ------------------------------------------------------------------ required

    @abc.abstractmethod
    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, float | Tensor]]:
        """``(loss, metrics)`` of one micro-batch: a scalar mean over its loss units, and
        detached scalars."""

    @abc.abstractmethod
    def create_collator(self, pad_token_id: int) -> Callable[[list[dict[str, Any]]], Any]:
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

    def build_batches(
        self, ctx: Any, groups: list[ScoredGroup]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Methods that generate: the step's scored groups as training micro-batches, and the
        method's rollout metrics (called by the rollout stage)."""
        raise NotImplementedError(f"{self.method_name} does not generate (needs_generation)")

    def create_packed_collator(self, pad_token_id: int) -> Any:
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

    def setup(self, ctx: Any) -> None:
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


#: Contract members an adapter reads from the wrapped object when it defines them.
FORWARDED: tuple[str, ...] = (
    "required_columns",
    "needs_reference_model",
    "needs_generation",
    "steps_per_batch",
    "model_kind",
    "fused",
    "logp_reduction",
    "budget_hint",
    "reference",
    "engine",
    "reward_funcs",
    "sampling",
    "needs_old_logps",
    "build_batches",
    "reference_logps",
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
    ) -> tuple[Tensor, dict[str, float | Tensor]]:
        return self.wrapped(model, batch, training=training)

    def create_collator(self, pad_token_id: int) -> Any:
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


def _forwarding(name: str) -> property:
    """A property reading ``name`` from the wrapped object, else the adapter's default."""
    default = inspect.getattr_static(MethodAdapter, name)

    def read(self: MethodAdapter) -> Any:
        value = getattr(self.wrapped, name, _ABSENT)  # the one place a method is probed
        if value is not _ABSENT:
            return value
        return default.__get__(self, MethodAdapter) if inspect.isfunction(default) else default

    return property(read, doc=f"``{name}`` of the wrapped object, or the contract's default.")


for _name in FORWARDED:
    setattr(MethodAdapter, _name, _forwarding(_name))


def as_method(obj: Any) -> GrimoireLoss:
    """``obj`` as a :class:`GrimoireLoss`: itself when it is one, else a :class:`MethodAdapter`
    over it (for the duck-typed protocol: an object with ``__call__`` and ``create_collator``)."""
    return obj if isinstance(obj, GrimoireLoss) else MethodAdapter(obj)


__all__ = ["FORWARDED", "GrimoireLoss", "MethodAdapter", "TokenLogpsLoss", "as_method"]
