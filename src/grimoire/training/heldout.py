"""Held-out measurements as callbacks: what a model can do, scored on every evaluation.

- :class:`ExactMatchCallback` (``exact_match``): greedy answers to held-out prompts against
  their answers: accuracy of a task;
- :class:`TextNLLCallback` (``text_nll``): the mean negative log-likelihood per token of plain
  text: how well the model still predicts general text (forgetting, when measured before and
  after fine-tuning on something else).

Both take a ``name``: with it their metrics are ``eval/<name>/...``, so several of them (a new
task, an earlier task, general text) log side by side in one run. Each rank scores a strided
shard of the rows and the sums are reduced, so the figures do not depend on the world size.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grimoire.columns import IGNORE_INDEX
from grimoire.forward.logprobs import compute_token_logps
from grimoire.rollout.engines.generation import generation_mode, greedy_generate_texts
from grimoire.rollout.rewards.answers import (
    EXTRACTORS,
    answers_match,
    extract_answer,
    reference_answer,
)
from grimoire.training.callbacks import TrainerCallback

_ARTICLES = re.compile(r"\b(a|an|the)\b")
#: ``match`` values of :class:`ExactMatchCallback`.
MATCHES = ("exact", "normalized", "contains")


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation (Rajpurkar et al. 2016, its evaluation script): lower case,
    punctuation and the articles a / an / the removed, whitespace collapsed.
    ``"The  Paris."`` -> ``"paris"``."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _metric(name: str | None, key: str) -> str:
    return f"eval/{name}/{key}" if name else f"eval/{key}"


def _shard(trainer, rows: Sequence[Any]) -> list[Any]:
    acc = trainer.accelerator
    return list(rows[acc.process_index :: acc.num_processes])


def _reduced(trainer, values: Sequence[float]) -> list[float]:
    # Sums, not means, are reduced: ranks' shards differ in size by up to one row.
    acc = trainer.accelerator
    t = torch.tensor(list(values), dtype=torch.float64, device=acc.device)
    return [float(v) for v in acc.reduce(t, reduction="sum")]


class ExactMatchCallback(TrainerCallback):
    """Held-out accuracy by greedy generation: logs ``eval/exact_match`` on every evaluation.

    ``rows`` are raw examples with ``prompt_field`` (a string, or a chat message list rendered
    with the generation prompt) and ``answer_field``. ``match`` says when a prediction counts:
    ``"exact"`` its decoded text, stripped, equals the answer; ``"normalized"`` the two are equal
    after :func:`normalize_answer` ("Paris." matches "paris"); ``"contains"`` the normalised
    answer appears in the normalised text as whole words ("The capital of France is Paris."
    contains "Paris", "Parisian" does not), for models that answer in a sentence; its metric is
    ``eval/answer_contained``, the others' ``eval/exact_match``. Each rank scores a strided
    shard; counts are summed over ranks.

    ``extract`` (``auto``, ``last_number``, ``boxed``, ``gsm8k``: the ``answer_match`` reward's
    extractors) also logs ``eval/answer_match``: the extracted answer equals the reference
    (numerically where both are numbers), whatever text surrounds it. The two apart tell a
    model that answers right in its own words from one that answers in the asked form; with
    ``eval/answer_only`` (the share of answers that are nothing but an extractable answer,
    right or wrong) and ``eval/answer_chars`` (the mean length of the stripped answers) they
    measure a behaviour such as "answer with the number only". ``name`` puts the metrics under
    ``eval/<name>/``.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        max_new_tokens: int = 16,
        batch_size: int = 32,
        extract: str | None = None,
        match: str = "exact",
        name: str | None = None,
    ):
        if extract is not None and extract not in EXTRACTORS:
            raise ValueError(
                f"ExactMatchCallback: extract={extract!r} is not one of {list(EXTRACTORS)}"
            )
        if match not in MATCHES:
            raise ValueError(f"ExactMatchCallback: match={match!r} is not one of {list(MATCHES)}")
        self.rows = list(rows)
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.extract = extract
        self.match = match
        self.name = name
        missing = [
            i for i, r in enumerate(self.rows) if prompt_field not in r or answer_field not in r
        ]
        if missing:
            raise ValueError(
                f"ExactMatchCallback: rows {missing[:10]} lack {prompt_field!r} or {answer_field!r}"
            )

    def on_evaluate(self, trainer, metrics: dict[str, float]) -> None:
        exact, answer, only, chars = self.scores(trainer)
        key = "answer_contained" if self.match == "contains" else "exact_match"
        metrics[_metric(self.name, key)] = exact
        if self.extract is not None:
            metrics[_metric(self.name, "answer_match")] = answer
            metrics[_metric(self.name, "answer_only")] = only
            metrics[_metric(self.name, "answer_chars")] = chars

    def _same(self, text: str, ref: str) -> bool:
        if self.match == "normalized":
            return normalize_answer(text) == normalize_answer(ref)
        if self.match == "contains":  # padded with spaces: whole words only
            return f" {normalize_answer(ref)} " in f" {normalize_answer(text)} "
        return text.strip() == ref

    @torch.no_grad()
    def scores(self, trainer) -> tuple[float, float, float, float]:
        """``(exact match, answer match, answer only, mean answer characters)`` over all ranks'
        rows (the two answer shares are 0 without ``extract``)."""
        shard = _shard(trainer, self.rows)
        texts = greedy_generate_texts(
            trainer.accelerator.unwrap_model(trainer.model),
            trainer.tokenizer,
            [r[self.prompt_field] for r in shard],
            self.max_new_tokens,
            self.batch_size,
        )
        refs = [str(r[self.answer_field]).strip() for r in shard]
        exact = sum(self._same(t, ref) for t, ref in zip(texts, refs))
        answer = only = 0
        if self.extract is not None:
            found = [extract_answer(t, self.extract) for t in texts]
            answer = sum(
                f is not None and answers_match(f, reference_answer(ref))
                for f, ref in zip(found, refs)
            )
            only = sum(f is not None and t.strip() == f.strip() for f, t in zip(found, texts))
        chars = sum(len(t.strip()) for t in texts)
        total = _reduced(trainer, [exact, answer, only, chars, len(shard)])
        n = max(total[4], 1.0)
        exact_share, answer_share, only_share, mean_chars = (c / n for c in total[:4])
        return exact_share, answer_share, only_share, mean_chars


class TextNLLCallback(TrainerCallback):
    """The negative log-likelihood of held-out plain text: logs ``eval/<name>/nll`` (nats per
    predicted token, every token of every row after its first, summed over rows and ranks and
    divided by their count: long rows weigh by their length) and ``eval/<name>/ppl``
    (``exp(nll)``) on every evaluation.

    ``rows`` have ``text_field``; each is tokenized as the tokenizer does plain text (its BOS
    where it adds one, no EOS) and cut to ``max_length`` tokens. Measured before and after a
    fine-tune, the change is the forgetting of general text. Batches are right-padded; the
    padding is masked out of the attention and the sum.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        text_field: str = "text",
        name: str = "text",
        max_length: int = 512,
        batch_size: int = 8,
    ):
        self.rows = list(rows)
        self.text_field = text_field
        self.name = name
        self.max_length = max_length
        self.batch_size = batch_size
        bad = [i for i, r in enumerate(self.rows) if not isinstance(r.get(text_field), str)]
        if bad or not self.rows:
            raise ValueError(
                f"TextNLLCallback: rows {bad[:10]} have no {text_field!r} string"
                if bad
                else "TextNLLCallback: no rows"
            )

    def on_evaluate(self, trainer, metrics: dict[str, float]) -> None:
        nll = self.nll(trainer)
        metrics[_metric(self.name, "nll")] = nll
        metrics[_metric(self.name, "ppl")] = float(torch.tensor(nll).exp())

    @torch.no_grad()
    def nll(self, trainer) -> float:
        """Mean NLL per predicted token over every rank's rows."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        device = next(model.parameters()).device
        tok = trainer.tokenizer
        shard = _shard(trainer, self.rows)
        encoded = [list(tok(r[self.text_field])["input_ids"])[: self.max_length] for r in shard]
        total = count = 0.0
        with generation_mode(model):
            for start in range(0, len(encoded), self.batch_size):
                batch = [e for e in encoded[start : start + self.batch_size] if len(e) > 1]
                if not batch:
                    continue
                width = max(len(e) for e in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                labels = torch.full_like(ids, IGNORE_INDEX)
                mask = torch.zeros_like(ids)
                for i, e in enumerate(batch):
                    ids[i, : len(e)] = labels[i, : len(e)] = torch.tensor(e)
                    mask[i, : len(e)] = 1
                # The shared chunked head: no [rows, width, vocab] logits even for long texts.
                out = compute_token_logps(model, ids.to(device), labels.to(device), mask.to(device))
                total -= float(out.logps.sum())
                count += float(out.mask.sum())
        total, count = _reduced(trainer, [total, count])
        return total / max(count, 1.0)


__all__ = ["MATCHES", "ExactMatchCallback", "TextNLLCallback", "normalize_answer"]
