"""``reward_model``: a trained sequence-classification reward model as a reward function.

The model (a folder written by ``save_pretrained``, e.g. by grimoire's reward modelling,
``loss.type: reward``) is an ``AutoModelForSequenceClassification`` with one score
(``num_labels=1``). It is loaded on the first call and kept, and scores ``prompt + completion``
in batches. Each text is encoded as reward modelling's ``tokenize_preference`` encodes a pair's
side, so the score is read where the model was trained to give it: the prompt with the
tokenizer's special tokens (not again when the prompt text already starts with BOS, as a rendered
chat template does), the completion without, then EOS. Rows are right-padded and the score is
transformers' own pooling (the last token that is not ``config.pad_token_id``), checked, per
batch, to be each row's last real token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: ``dtype`` values: the checkpoint's own (``auto``) or a torch dtype's name.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def pooling_mismatches(ids: Tensor, mask: Tensor, pad: int) -> list[int]:
    """Rows whose score transformers reads at another position than their last real token
    (their last real token is the pad id, e.g. ``pad == eos`` with EOS appended)."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    last_real = (positions * mask.long()).argmax(-1)
    pooled = (positions * (ids != pad).long()).argmax(-1)
    return (pooled != last_real).nonzero().flatten().tolist()


def right_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[Tensor, Tensor]:
    """``[B, T]`` ids right-padded with ``pad`` and their ``[B, T]`` attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


class RewardModelReward:
    """``reward_model``: the score of a trained reward model for ``prompt + completion``.

    Args:
        path: the checkpoint folder (model and tokenizer, ``save_pretrained``).
        batch_size: texts per forward (memory only; the scores do not depend on it).
        max_length: keep a text's LAST ``max_length`` tokens (where the score is read); None
            keeps all.
        device: where the model runs (default: the current CUDA device, else the CPU).
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.

    Loaded with ``trust_remote_code=False``: a checkpoint that needs its own code is refused.
    """

    __name__ = "reward_model"

    def __init__(
        self,
        path: str,
        batch_size: int = 16,
        max_length: int | None = None,
        device: str | None = None,
        dtype: str = "auto",
    ):
        if not isinstance(path, str | Path) or not (Path(path) / "config.json").is_file():
            raise ValueError(f"path: {path!r} is not a model folder (no config.json in it)")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise ValueError(f"max_length must be None or an int >= 2, got {max_length!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        self.path, self.batch_size, self.max_length = str(path), batch_size, max_length
        self.device, self.dtype = device, dtype
        self._loaded: tuple[Any, Any] | None = None

    def load(self) -> tuple[Any, Any]:
        """``(model, tokenizer)``, loaded once (eval mode, on :attr:`device`)."""
        if self._loaded is not None:
            return self._loaded
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)
        dtype = self.dtype if self.dtype == "auto" else getattr(torch, self.dtype)
        model = AutoModelForSequenceClassification.from_pretrained(
            self.path, num_labels=1, dtype=dtype, trust_remote_code=False
        )
        if model.config.pad_token_id is None:
            # Batches are padded: transformers finds each row's last token through this id.
            if tokenizer.pad_token_id is None:
                raise ValueError(
                    f"reward_model {self.path!r}: neither the model's config nor the tokenizer "
                    "has a pad token id, so padded batches cannot be scored; set one"
                )
            model.config.pad_token_id = tokenizer.pad_token_id
        if self.device is None:
            self.device = (
                f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            )
        self._loaded = (model.to(self.device).eval(), tokenizer)
        return self._loaded

    def encode(self, tokenizer: Any, prompt: str, completion: str) -> list[int]:
        """One text's ids: the prompt (special tokens unless it already starts with BOS), the
        completion, EOS; then its last :attr:`max_length` tokens."""
        bos = tokenizer.bos_token
        special = not (bos and prompt.startswith(bos))
        ids = list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
        ids += tokenizer(completion, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        return ids[-self.max_length :] if self.max_length else ids

    @torch.inference_mode()
    def score_ids(self, rows: Sequence[Sequence[int]]) -> list[float]:
        """The model's score of each token sequence, in batches of :attr:`batch_size` (longest
        first, so a batch pads little)."""
        model, _ = self.load()
        pad = int(model.config.pad_token_id)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out = [0.0] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ids, mask = right_padded([rows[i] for i in chunk], pad)
            bad = pooling_mismatches(ids, mask, pad)
            if bad:
                raise ValueError(
                    f"reward_model {self.path!r}: a text ends with the pad token id {pad} (pad == "
                    "eos?), so transformers would read its score elsewhere; give the tokenizer a "
                    "distinct pad token and set model.config.pad_token_id to it"
                )
            logits = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
            scores = logits.logits
            if scores.dim() != 2 or scores.shape[-1] != 1:
                raise ValueError(
                    f"reward_model {self.path!r}: expected one score per text (num_labels=1), "
                    f"got logits of shape {tuple(scores.shape)}"
                )
            for i, s in zip(chunk, scores[:, 0].float().cpu().tolist()):
                out[i] = s
        return out

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **kwargs: Any
    ) -> list[float]:
        _, tokenizer = self.load()
        rows = [self.encode(tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
        return self.score_ids(rows)


__all__ = ["DTYPES", "RewardModelReward", "pooling_mismatches", "right_padded"]
