"""Held-out callbacks: named metrics side by side, SQuAD-normalised matching, and the text NLL
against a naive full-logits reference on a tiny model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grimoire.training import heldout
from grimoire.training.heldout import ExactMatchCallback, TextNLLCallback, normalize_answer


def _trainer(model=None, tokenizer=None) -> SimpleNamespace:
    acc = SimpleNamespace(
        process_index=0,
        num_processes=1,
        device="cpu",
        unwrap_model=lambda m: m,
        reduce=lambda t, reduction: t,
    )
    return SimpleNamespace(accelerator=acc, model=model, tokenizer=tokenizer)


def test_normalize_answer_hand_worked():
    assert normalize_answer("The  Paris.") == "paris"
    assert normalize_answer(" Buenos Aires! ") == "buenos aires"
    assert normalize_answer("an Apple, a day") == "apple day"
    assert normalize_answer("Washington, D.C.") == "washington dc"


def test_exact_match_with_extract_tells_the_asked_form_from_a_right_answer(monkeypatch):
    """Hand-worked: 4 answers to 4 sums; exact needs the bare number, extract finds the last one."""
    texts = ["68", "The answer is 1,000.", "12 + 30 = 41", " 7 "]
    monkeypatch.setattr(heldout, "greedy_generate_texts", lambda *a: texts)
    trainer = _trainer()
    rows = [{"prompt": "q", "answer": a} for a in ("68", "1000", "42", "7")]
    metrics: dict[str, float] = {}
    ExactMatchCallback(rows, extract="last_number").on_evaluate(trainer, metrics)
    assert metrics == {
        "eval/exact_match": 2 / 4,  # "68" and "7" (stripped)
        "eval/answer_match": 3 / 4,  # + "1,000" == 1000; 41 != 42
        "eval/answer_only": 2 / 4,  # "68", " 7 ": nothing but the number
        "eval/answer_chars": (2 + 20 + 12 + 1) / 4,
    }
    metrics.clear()
    ExactMatchCallback(rows).on_evaluate(trainer, metrics)
    assert metrics == {"eval/exact_match": 0.5}
    with pytest.raises(ValueError, match="extract='last'"):
        ExactMatchCallback(rows, extract="last")


def test_named_exact_match_normalised_and_contained(monkeypatch):
    texts = ["Paris.", "the city is Berlin", "rome", " Madrid ", "Parisian food"]
    monkeypatch.setattr(heldout, "greedy_generate_texts", lambda *a: texts)
    answers = ("Paris", "Berlin", "Rome", "Madrid", "Paris")
    rows = [{"prompt": "q", "answer": a} for a in answers]
    metrics: dict[str, float] = {}
    ExactMatchCallback(rows, match="normalized", name="capitals").on_evaluate(_trainer(), metrics)
    # "Paris.", "rome" match once normalised; " Madrid " strips; the other two do not.
    assert metrics == {"eval/capitals/exact_match": 3 / 5}
    metrics.clear()
    ExactMatchCallback(rows, match="contains", name="capitals").on_evaluate(_trainer(), metrics)
    # + "the city is Berlin"; "Parisian" is not the word "Paris".
    assert metrics == {"eval/capitals/answer_contained": 4 / 5}
    metrics.clear()
    ExactMatchCallback(rows).on_evaluate(_trainer(), metrics)
    assert metrics == {"eval/exact_match": 1 / 5}  # only " Madrid " once stripped
    with pytest.raises(ValueError, match="match='fuzzy' is not one of"):
        ExactMatchCallback(rows, match="fuzzy")


def test_text_nll_equals_a_naive_full_logits_reference(tiny_model, tokenizer):
    model, tok = tiny_model, tokenizer
    model.eval()
    rows = [{"text": t} for t in ("hello world", "abc", "a longer line of text here", "x")]
    # Naive: each row alone, full logits, log_softmax, the next token's log-prob summed.
    total = count = 0.0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([tok(r["text"])["input_ids"]])
            if ids.shape[1] < 2:
                continue  # one token: nothing is predicted
            logits = model(input_ids=ids).logits[0, :-1].double()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])
            total -= float(lp.sum())
            count += ids.shape[1] - 1
    want = total / count
    metrics: dict[str, float] = {}
    cb = TextNLLCallback(rows, name="general", batch_size=3)  # a batch with padding
    cb.on_evaluate(_trainer(model, tok), metrics)
    assert metrics["eval/general/nll"] == pytest.approx(want, rel=1e-5)
    assert metrics["eval/general/ppl"] == pytest.approx(math.exp(want), rel=1e-5)
    assert model.training is False  # evaluation leaves the mode as it found it


def test_text_nll_rejects_rows_without_text():
    with pytest.raises(ValueError, match=r"rows \[1\] have no 'text' string"):
        TextNLLCallback([{"text": "ok"}, {"body": "no"}])
    with pytest.raises(ValueError, match="no rows"):
        TextNLLCallback([])
