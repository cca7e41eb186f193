"""The method contract's defaults: :class:`GrimoireLoss`, the base of every built-in method.

The contract itself, what the run reads from a method, is declared once at the bottom of the
layers (:mod:`grimoire.contract.method`): its core (:class:`~grimoire.contract.method.MethodCore`:
``__call__``, ``create_collator``, ``loss_weight``), which every method writes, and the opt-in
capabilities of :class:`~grimoire.contract.method.Method`. :class:`GrimoireLoss` leaves the core
abstract and gives every capability its default; behaviour that differs between methods
(reference models, generation, token budgets) lives in these members, never as branches in the
loop. The callers call them directly, never probing. A duck-typed method gets the same defaults
from :mod:`grimoire.losses.adapter`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from grimoire.batching.budget import default_budget_tokens, truncate_sequences
from grimoire.columns import columns_of
from grimoire.config.context import TrainingContext
from grimoire.contract.method import Collator, Method, MethodReference
from grimoire.forward.reference import Reference


class GrimoireLoss(abc.ABC):
    """The base of every training method: :class:`~grimoire.contract.method.Method` (the
    contract, documented there) with a default for each capability.

    Required (abstract): the core, :meth:`__call__` (the loss of one micro-batch),
    :meth:`create_collator` and :meth:`loss_weight` (the loss units that loss is a mean over;
    there is no default: a wrong one would silently change the objective under accumulation).
    Every capability has a default below; override what the method needs. A method that generates
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

    @abc.abstractmethod
    def loss_weight(self, batch: dict[str, Any]) -> float:
        """The loss units in ``batch``, what :meth:`__call__`'s loss is a mean over: trained
        tokens for a token mean (``num_targets(batch)``), rows for a row mean
        (``num_rows(batch)``: the samples of a packed row too), pairs for a pair mean. The
        trainer weights each micro-batch by it, so accumulation and several processes optimise
        the mean over the whole step."""

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
        return holds_module(self.reference)

    def create_packed_collator(self, pad_token_id: int) -> Collator | None:
        """Padding-free collator (one packed row per micro-batch), or None when unsupported."""
        return None

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
        return column_problems(dataset, split, self.method_name, self._missing_columns)

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


def holds_module(reference: MethodReference | None) -> bool:
    """Whether ``reference`` holds its model already, given as a module (the default of
    ``holds_reference``)."""
    return reference is not None and isinstance(reference.ref_model, torch.nn.Module)


def column_problems(
    dataset: Any, split: str, method_name: str, missing: Callable[[set[str]], list[str]]
) -> list[str]:
    """The default ``validate_dataset``: the one problem of a ``dataset`` whose column names
    ``missing`` finds columns missing from, or none."""
    names = set(columns_of(dataset))
    absent = missing(names)
    if absent:
        return [
            f"{split} dataset: missing column(s) {absent} needed by {method_name}; "
            f"it has {sorted(names)} (tokenize it with the matching grimoire.data function)"
        ]
    return []


# The contract GrimoireLoss implements, checked by the type checker here (structurally: the
# Protocols' members are read-only properties, which attributes and properties both satisfy).
_IMPLEMENTS: type[Method] = GrimoireLoss


__all__ = ["GrimoireLoss", "TokenLogpsLoss", "column_problems", "holds_module"]
