"""The contract, tried from outside with the smallest custom method docs/custom-loss.md shows
(``MinimalLoss``: Hugging Face's token-mean loss, its collator and its ``loss_weight``, built from
the page's own code block): gradient accumulation and 2 processes optimise the same token mean as
one big batch, a method without ``loss_weight`` is refused before training, by name, and the
page's methods import from one public module."""

from __future__ import annotations

import ast
import itertools
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from tests.helpers.doc_methods import doc_class_blocks, docs_minimal_loss
from tests.helpers.train_utils import params_of, quiet_config, train
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer
from grimoire.cli.main import main
from grimoire.losses import GrimoireLoss
from grimoire.model.tiny import reverse_rows, write_jsonl

#: Rows of very different lengths (every token trained): how micro-batches are split decides
#: how many tokens each holds, so a per-micro-batch mean would weigh them differently.
LENGTHS = (3, 5, 7, 60)
LR = 1.0


def _rows() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(3, 64, (n,), generator=gen).tolist()  # the tiny vocabulary: 64
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def _sgd_step(model: torch.nn.Module, objective: torch.Tensor) -> dict[str, torch.Tensor]:
    objective.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return params_of(model)


def _row_nll(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Summed next-token NLL of one row on its own (no padding, no collator)."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1]
    return F.cross_entropy(logits.float(), x[0, 1:], reduction="sum")


def token_mean_step(tiny_dir, rows, micro_batches=None) -> dict[str, torch.Tensor]:
    """The independent reference: one SGD step on the mean NLL over every trained token of
    ``rows``; with ``micro_batches`` (lists of row indices), on the mean of each micro-batch's
    token mean instead: what a weight of 1 per micro-batch optimises."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    if micro_batches is None:
        total = sum(_row_nll(model, r["input_ids"]) for r in rows)
        return _sgd_step(model, total / sum(len(r["input_ids"]) - 1 for r in rows))
    means = [
        sum(_row_nll(model, rows[i]["input_ids"]) for i in mb)
        / sum(len(rows[i]["input_ids"]) - 1 for i in mb)
        for mb in micro_batches
    ]
    return _sgd_step(model, sum(means) / len(means))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_custom_loss_accumulation_equals_one_big_batch_and_the_token_mean(
    tiny_dir, tokenizer, tmp_path, one_thread
):
    minimal_loss = docs_minimal_loss()
    rows = _rows()
    common = dict(
        optimizer="sgd", learning_rate=LR, weight_decay=0.0, max_grad_norm=None, max_steps=1
    )
    runs = {
        name: train(
            AutoModelForCausalLM.from_pretrained(tiny_dir),
            tokenizer,
            rows,
            minimal_loss(),
            quiet_config(tmp_path / name, **config, **common),
        ).unwrapped_model
        for name, config in {
            "big": dict(batch_size=4),
            "accumulated": dict(batch_size=2, gradient_accumulation_steps=2),
        }.items()
    }
    reference = token_mean_step(tiny_dir, rows)
    before = params_of(AutoModelForCausalLM.from_pretrained(tiny_dir))
    assert _max_diff(reference, before) > 1e-2, "the step must move the parameters"
    for name, model in runs.items():
        assert _max_diff(params_of(model), reference) < 2e-6, name
    # The test can fail: every 2 + 2 split, weighted 1 per micro-batch (what the trainer did
    # with a method without loss_weight), lands far from the token-mean step.
    for first in itertools.combinations(range(4), 2):
        split = [list(first), [i for i in range(4) if i not in first]]
        assert _max_diff(token_mean_step(tiny_dir, rows, split), reference) > 1e-3, split


# The custom loss on 2 processes against 1: tests/test_distributed.py's "custom-loss" case
# (the same launches as its other cases).


def test_a_custom_loss_without_loss_weight_is_refused_before_training(
    tiny_model, tokenizer, tmp_path
):
    minimal_loss = docs_minimal_loss()

    class NoWeight:  # duck-typed: the docs' method without its normaliser
        __call__ = minimal_loss.__call__
        create_collator = minimal_loss.create_collator

    with pytest.raises(TypeError, match="NoWeight is not a training method: it has no loss_weight"):
        GrimoireTrainer(
            model=tiny_model,
            tokenizer=tokenizer,
            config=quiet_config(tmp_path),
            loss_fn=NoWeight(),
            train_dataset=_rows(),
        )

    class Subclass(GrimoireLoss):  # the same method on the base class: Python refuses it
        __call__ = minimal_loss.__call__
        create_collator = minimal_loss.create_collator

    with pytest.raises(
        TypeError, match="abstract method 'loss_weight'|abstract method loss_weight"
    ):
        Subclass()  # type: ignore[abstract]


NO_WEIGHT_MODULE = """
from grimoire.losses import SFTCollator


class NoWeight:
    def __call__(self, model, batch, training=True):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        return out.loss, {}

    def create_collator(self, pad_token_id):
        return SFTCollator(pad_token_id=pad_token_id)
"""


def test_grimoire_validate_refuses_a_custom_loss_without_loss_weight(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() adds the config's folder
    (tmp_path / "noweight_losses.py").write_text(NO_WEIGHT_MODULE)
    raw = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {
            "jsonl": str(write_jsonl(reverse_rows(4, seed=0), tmp_path / "data.jsonl")),
            "tokenize": {"type": "sft"},
        },
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1},
        "loss": {"type": "noweight_losses:NoWeight"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert main(["validate", "--config", str(tmp_path / "run.yaml")]) == 1
    err = capsys.readouterr().err
    assert "loss: noweight_losses:NoWeight: NoWeight is not a training method: it has no " in err
    assert "loss_weight. Define loss_weight(batch)" in err


def test_the_custom_loss_docs_import_from_one_public_module():
    """Every method docs/custom-loss.md defines imports Grimoire's names from grimoire.losses."""
    blocks = doc_class_blocks()
    assert len(blocks) >= 2  # MinimalLoss, FocalSFTLoss
    for block in blocks:
        modules = {
            node.module
            for node in ast.walk(ast.parse(block.code))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grimoire")
        }
        modules |= {
            alias.name
            for node in ast.walk(ast.parse(block.code))
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("grimoire")
        }
        assert modules == {"grimoire.losses"}, (block.line, modules)
