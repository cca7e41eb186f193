"""KTO collation: unpaired rows of :func:`grimoire.rows.kto.tokenize_kto` plus their
mismatched KL pairs (see :mod:`grimoire.rows.kto`), padded or packed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grimoire.collate.common import collate_prefixed
from grimoire.collate.packing import pack_row_sides
from grimoire.rows.kto import mismatched_pair, with_label

#: A KTO row's two sequences, by column prefix: its own completion, then its mismatched KL pair.
KTO_SIDES: tuple[str, str] = ("", "kl_")


@dataclass
class KTOCollator:
    """Pads KTO rows and adds the mismatched KL pairs ``kl_input_ids/kl_attention_mask/kl_labels``.

    In-batch pairs join prompt ``i`` with completion ``(i + 1) mod B``. With ``B == 1`` that is
    the row's own completion (the KL estimate then equals the implied reward): train KTO with a
    per-device batch size of at least 2, or cache the pairs at dataset level. Rows that already
    hold ``kl_input_ids``/``kl_labels`` (cached pairs) keep them. ``max_length`` (the trainer's
    ``max_length``, set by ``KTOLoss.setup`` when left None) bounds a pair's length. Layout:
    :class:`~grimoire.contract.layout.Padded`.
    """

    pad_token_id: int
    max_length: int | None = None

    def with_kl_pairs(self, features: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The rows with their mismatched pair as ``kl_input_ids/kl_attention_mask/kl_labels``.

        Shared by the padded and the packed collator so both train on the very same pairs. Rows
        tokenized by grimoire-rl carry their label as ``kto_label``: it becomes ``label`` here.
        """
        if not features:
            raise ValueError(f"{type(self).__name__} got an empty batch")
        features = [with_label(f) for f in features]
        if "kl_input_ids" in features[0]:
            rows = features
            for r in rows:
                r.setdefault("kl_attention_mask", [1] * len(r["kl_input_ids"]))
            return rows
        n = len(features)
        rows = []
        for i, f in enumerate(features):
            kl_ids, kl_labels = mismatched_pair(f, features[(i + 1) % n], self.max_length)
            rows.append(
                {
                    **f,
                    "kl_input_ids": kl_ids,
                    "kl_attention_mask": [1] * len(kl_ids),
                    "kl_labels": kl_labels,
                }
            )
        return rows

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = collate_prefixed(self.with_kl_pairs(features), self.pad_token_id, KTO_SIDES)
        if "label" in batch:
            batch["label"] = torch.as_tensor(batch["label"]).bool()
        return batch


#: Token columns a packed KTO batch replaces by its packed row (the rest ride along per row).
_TOKEN_COLUMNS = ("input_ids", "attention_mask", "labels", "position_ids")


@dataclass
class PackedKTOCollator(KTOCollator):
    """Padding-free KTO: one ``[1, L]`` row holding the ``B`` completions, then their ``B``
    mismatched KL pairs (samples ``B .. 2B-1``; the same pairs :class:`KTOCollator` builds).

    Output: :func:`grimoire.collate.packing.pack_samples`' keys (``input_ids``, ``labels``,
    ``position_ids``, ``sample_index``, and ``layout``: a
    :class:`~grimoire.contract.layout.Packed` of ``2B`` samples) plus every other per-row column
    (``label`` as bool, cached ``ref_logps``/``ref_kl_logps`` as tensors; non-numeric ones, e.g.
    ``ref_logps_reduction``, as lists). A subclass of :class:`KTOCollator` so that
    ``KTOLoss.setup`` bounds its pairs with the trainer's ``max_length`` the same way.
    """

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = pack_row_sides(
            self.with_kl_pairs(features),
            KTO_SIDES,
            self.pad_token_id,
            lambda key: key in _TOKEN_COLUMNS or key.startswith("kl_"),
        )
        if "label" in batch:
            batch["label"] = torch.as_tensor(batch["label"]).bool()
        return batch


__all__ = ["KTO_SIDES", "KTOCollator", "PackedKTOCollator"]
