"""A collated batch's layout as a type: :class:`Padded` rows or one :class:`Packed` row.

Which forward a batch needs (a ``[B, T]`` call with an attention mask, or one ``[1, L]`` call with
``position_ids`` and no mask whose result is cut back into samples) is not guessed from its keys
(``"seq_lens" in batch``): a key can be dropped, renamed or added by a user collator without
anyone noticing, and every guess would have to be kept in step with the others. Whoever builds
the batch (a collator, the rollout) says what it built, under
:data:`LAYOUT_KEY`, and :func:`grimoire.forward.batch.sample_token_logps` is the one place that
dispatches on it.

A batch without the key is :class:`Padded`: a user collator that returns a plain padded dict
keeps working unchanged.

Layouts are frozen, hashable and picklable (DataLoader workers collate in another process and
send the batch back), and hold only host-side Python values: reading them never waits for a
device. The trainer moves a batch's tensors to the device and passes every other value, the
layout included, through as it is.

A layout may also carry what the collator counted on the host while it still held the rows as
lists: the trained targets (``targets``: the LM head's row count, so the forward can size it
without a ``nonzero`` on the device), the real tokens and whether rows are right-padded
(``Padded``), and, for a packed row whose ``position_ids`` restart inside a sample (pretrain
blocks), the attention segments. These are facts about the same tensors, so
they are left out of equality (``compare=False``): a layout built by hand without them equals
the collator's.

The layout answers what code outside ``collate/`` would otherwise read from the keys (:func:`num_rows`,
:func:`num_targets`, :func:`num_tokens`, :func:`is_prompt_batch`, :func:`attention_inputs`),
from the collator's counts when it has them and from the tensors when not (a user collator's
plain dict); only ``collate/`` and this module read :data:`LAYOUT_KEYS` (a test checks). The one
shifted-target rule (:func:`shifted_targets`, :func:`shift_labels`) lives here too, so the
collators' host-side counts and the forward's targets cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, ClassVar

import torch

from grimoire.columns import IGNORE_INDEX

#: The batch key under which a collator (or the rollout) states its batch's layout.
LAYOUT_KEY = "layout"


@dataclass(frozen=True)
class Padded:
    """``[B, T]`` rows, one sample per row, right-padded (left-padded prompts for generation),
    with an ``attention_mask`` (or, for pretrain blocks, ``position_ids`` marking document
    boundaries inside each row). A forward's result is already one row per sample.

    Attributes:
        targets: per column prefix (``""``, ``"chosen_"``, ...), the trained targets of its rows
            after the shift (``labels[:, 1:] != -100``), counted on the host by the collator;
            None when unknown (a user collator).
        right_padded: every row's padding is at its end and ``position_ids`` (if any) count up
            without restarts, so plain causal attention without a mask is exact for every real
            token (a real token never sees a later position). Set by grimoire's own collators.
        tokens: the real (unpadded) input tokens over every prefix, counted on the host.
        rows: the batch's rows ``B`` (for rows of several sequences, e.g. preference pairs,
            the rows of each side's tensors); None when not stated (a user collator).
        prompts: the rows are prompts to sample from, with nothing to train on yet. In
            training the rollout stage turns them into training rows; a method is handed such
            a batch only to evaluate, so this is how a batch says it is for evaluation.
    """

    targets: tuple[tuple[str, int], ...] | None = field(default=None, compare=False)
    right_padded: bool = field(default=False, compare=False)
    tokens: int | None = field(default=None, compare=False)
    rows: int | None = field(default=None, compare=False)
    prompts: bool = field(default=False, compare=False)

    @property
    def num_targets(self) -> int | None:
        """Trained targets over every prefix (None when not counted)."""
        return None if self.targets is None else sum(n for _, n in self.targets)

    def sides(self, prefixes: tuple[str, ...]) -> Padded:
        """The layout of ``prefixes``' rows alone (or stacked), as un-prefixed rows."""
        counts = dict(self.targets) if self.targets is not None else None
        rows = None if self.rows is None else self.rows * len(prefixes)
        if counts is None or any(p not in counts for p in prefixes):
            return Padded(None, self.right_padded, rows=rows)
        targets = (("", sum(counts[p] for p in prefixes)),)
        return Padded(targets, self.right_padded, rows=rows)  # tokens: not counted per side


@dataclass(frozen=True)
class Packed:
    """One ``[1, L]`` row: the samples back to back, ``position_ids`` restarting at 0 at each,
    no attention mask (padding-free). A forward's result is cut back into per-sample rows.

    Attributes:
        seq_lens: each sample's token count, in row order, as HOST integers: the loss code can
            size and cut the row, and varlen attention kernels can be given ``cu_seqlens`` /
            ``max_seqlen``, without a device-to-host copy (which would stall the stream). Padding
            appended by ``pad_to_multiple_of`` is not a sample and is not counted: the row may be
            longer than ``sum(seq_lens)``.
        targets: per sample, its trained targets after the shift (a target is attributed to the
            sample holding the target token), counted on the host; None when unknown.
        segments: the attention segments (where ``position_ids`` restart) when they differ from
            the samples, i.e. pretrain blocks holding several documents; None: one per sample.
    """

    seq_lens: tuple[int, ...]
    targets: tuple[int, ...] | None = field(default=None, compare=False)
    segments: tuple[int, ...] | None = field(default=None, compare=False)

    #: A packed row is always trained on (prompts to sample from are padded).
    prompts: ClassVar[bool] = False

    def __post_init__(self) -> None:
        lens = tuple(int(n) for n in self.seq_lens)  # also accepts a list or numpy ints
        if not lens or min(lens) < 1:
            raise ValueError(f"Packed needs at least one sample, each of >= 1 token: {lens}")
        object.__setattr__(self, "seq_lens", lens)
        if self.targets is not None:
            object.__setattr__(self, "targets", tuple(int(n) for n in self.targets))
            if len(self.targets) != len(lens):
                raise ValueError(f"Packed: {len(self.targets)} target counts for {len(lens)}")
        if self.segments is not None:
            object.__setattr__(self, "segments", tuple(int(n) for n in self.segments))

    @property
    def num_samples(self) -> int:
        return len(self.seq_lens)

    @property
    def rows(self) -> int:
        """The samples in the row (each is a row of the padded batch it replaces)."""
        return len(self.seq_lens)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Sample offsets in the row, ``(0, l0, l0 + l1, ..., sum)`` (``num_samples + 1``
        values): flash-attention's varlen ``cu_seqlens``, and where to cut the row."""
        return (0, *accumulate(self.seq_lens))

    @property
    def max_seqlen(self) -> int:
        """The longest sample (varlen kernels' ``max_seqlen``; the width of unpacked rows)."""
        return max(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """The samples' tokens, without any end padding."""
        return sum(self.seq_lens)

    @property
    def num_targets(self) -> int | None:
        """Trained targets in the row (None when not counted)."""
        return None if self.targets is None else sum(self.targets)

    def attention_segments(self, row_len: int) -> tuple[int, ...]:
        """The lengths attention runs causally within, covering all ``row_len`` positions: the
        samples (or documents, see ``segments``), then any end padding as a segment of its own
        (its ``position_ids`` restart at 0 too, so no real token attends to it)."""
        segments = self.segments or self.seq_lens
        tail = row_len - sum(segments)
        if tail < 0:
            raise ValueError(f"a packed row of {row_len} positions holds {sum(segments)} tokens")
        return (*segments, tail) if tail else segments

    def split(self, n: int) -> tuple[Packed, Packed]:
        """The first ``n`` samples and the rest, as two packed rows (the row cut at
        ``cu_seqlens[n]``: positions restart at every sample, so each part is a valid row)."""
        if not 0 < n < self.num_samples:
            raise ValueError(f"cannot split {self.num_samples} packed samples after {n}")
        if self.segments is not None:
            raise ValueError("a packed row of documents (pretrain blocks) is not split")
        t = self.targets
        first = Packed(self.seq_lens[:n], None if t is None else t[:n])
        return first, Packed(self.seq_lens[n:], None if t is None else t[n:])


#: What a batch's :data:`LAYOUT_KEY` holds.
BatchLayout = Padded | Packed


def layout_of(batch: Mapping[str, Any]) -> BatchLayout:
    """The batch's layout; :class:`Padded` when it states none (a user collator's plain dict).

    Raises:
        TypeError: when :data:`LAYOUT_KEY` holds something other than a layout (a user column
            that happens to be called ``layout`` would otherwise be misread silently).
    """
    layout = batch.get(LAYOUT_KEY)
    if layout is None:
        return Padded()
    if not isinstance(layout, Padded | Packed):
        raise TypeError(
            f"batch[{LAYOUT_KEY!r}] must be a Padded or Packed layout, got "
            f"{type(layout).__name__}; rename that column"
        )
    return layout


def shifted_targets(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """THE shifted-target rule: which positions hold a trained TARGET token. A token is a
    target when its label is not ``-100`` and a position before it in the same sample predicts
    it: not in the first column, and (packed rows, pretrain blocks) not where ``position_ids``
    restart at 0, where the position before belongs to another sample. Indexed by the target
    token; :func:`shift_labels` lays the same targets out by predicting position. Shapes:
    ``[B, T]`` -> ``[B, T]`` bool. The collators run it on host tensors to count targets."""
    keep = labels != IGNORE_INDEX
    keep[:, 0] = False
    if position_ids is not None:
        keep &= position_ids != 0
    return keep


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Targets per predicting position: ``out[:, t] = labels[:, t + 1]`` where
    :func:`shifted_targets` keeps it, ``-100`` elsewhere (and in the last column). Shapes:
    ``[B, T]`` -> ``[B, T]``, ``labels``' dtype."""
    keep = shifted_targets(labels, position_ids)
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:].masked_fill(~keep[:, 1:], IGNORE_INDEX)
    return out


def num_rows(batch: Mapping[str, Any]) -> int:
    """The batch's rows (samples): a packed row's samples, a padded batch's rows (as its
    collator counted them, else the first ``*input_ids`` tensor's; 1 when it has none)."""
    layout = layout_of(batch)
    if layout.rows is not None:
        return layout.rows
    for key, value in batch.items():
        if key.endswith("input_ids") and isinstance(value, torch.Tensor):
            return int(value.shape[0])
    return 1


def attention_inputs(
    batch: Mapping[str, Any], prefix: str = ""
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(attention_mask, position_ids)`` of ``prefix``'s rows, as the model takes them: a
    packed row has ``position_ids`` and no mask; padded rows a mask, and ``position_ids`` too
    when they mark document boundaries (pretrain blocks); a user collator may give neither."""
    return batch.get(f"{prefix}attention_mask"), batch.get(f"{prefix}position_ids")


def target_mask(batch: Mapping[str, Any], prefix: str = "") -> torch.Tensor:
    """``[B, T]`` bool: where ``prefix``'s rows hold a trained target (:func:`shifted_targets`
    of its ``labels``, with the ``position_ids`` where samples or documents restart)."""
    return shifted_targets(batch[f"{prefix}labels"], attention_inputs(batch, prefix)[1])


def num_targets(batch: Mapping[str, Any]) -> int:
    """The batch's trained targets: the collator's host-side count when its layout has one,
    else counted from the labels (a read from wherever the tensors are)."""
    counted = layout_of(batch).num_targets
    return counted if counted is not None else int(target_mask(batch).sum())


def num_tokens(batch: Mapping[str, Any]) -> int:
    """Real (non-pad) input tokens over every ``*input_ids`` column: the layout's host-side
    count when it has one (a collator's padded rows, a packed row's samples), else each column's
    ``attention_mask`` sum (all of its positions when it has none)."""
    layout = layout_of(batch)
    if isinstance(layout, Packed):
        return layout.num_tokens
    if layout.tokens is not None:
        return layout.tokens
    total = 0
    for key, value in batch.items():
        if key.endswith("input_ids") and isinstance(value, torch.Tensor):
            mask = batch.get(key.replace("input_ids", "attention_mask"))
            total += int(mask.sum()) if isinstance(mask, torch.Tensor) else value.numel()
    return total


def is_prompt_batch(batch: Mapping[str, Any]) -> bool:
    """Whether the batch holds prompts to sample from (:attr:`Padded.prompts`), which a method
    that generates is handed only to evaluate."""
    return layout_of(batch).prompts


def to_device(batch: Mapping[str, Any], device: Any) -> dict[str, Any]:
    """A batch's tensors on ``device``, every other value (the layout included) as it is.

    The copies are ``non_blocking``: a blocking host-to-device copy waits for every kernel
    already queued on the stream (a host sync per tensor); the layout carries what the step
    needs to know on the host, so nothing here has to wait."""
    device = torch.device(device)
    blocking = device.type == "cpu"
    return {
        k: v.to(device, non_blocking=not blocking) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


#: The batch keys that tell a batch's layout apart (besides :data:`LAYOUT_KEY` itself). Only
#: ``collate/`` (which writes them) and this module read them to learn the layout; everyone
#: else asks the layout (tests/test_layout_keys.py checks).
LAYOUT_KEYS = (
    LAYOUT_KEY,
    "position_ids",
    "attention_mask",
    "sample_index",
    "seq_lens",
    "cu_seqlens",
    "max_seqlen",
)

__all__ = [
    "LAYOUT_KEY",
    "LAYOUT_KEYS",
    "BatchLayout",
    "Packed",
    "Padded",
    "attention_inputs",
    "is_prompt_batch",
    "layout_of",
    "num_rows",
    "num_targets",
    "num_tokens",
    "shift_labels",
    "shifted_targets",
    "target_mask",
    "to_device",
]
