"""Every method's logged metric names equal the tables in docs/losses.md ("Logged metrics").

Each method runs once on a tiny batch (online methods: one rollout step, then the loss), and the
union of the keys it returns is compared with the documented table, so the doc cannot drift.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import method_context
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from grimoire.collate.kto import KTOCollator
from grimoire.collate.preference import PreferenceCollator
from grimoire.collate.prompts import GRPOCollator
from grimoire.collate.sft import SFTCollator
from grimoire.losses import (
    CPOLoss,
    DistillMethod,
    DPOLoss,
    GRPOMethod,
    IPOLoss,
    KTOLoss,
    OnlineDPOMethod,
    ORPOLoss,
    RAFTMethod,
    RewardModelLoss,
    RLOOMethod,
    SFTLoss,
    SimPOLoss,
)
from grimoire.model.tiny import build_model, kto_rows, preference_rows, reverse_rows
from grimoire.rows.kto import tokenize_kto
from grimoire.rows.preference import tokenize_preference
from grimoire.rows.prompts import tokenize_grpo
from grimoire.rows.sft import tokenize_sft
from grimoire.training.setup import build_rollouts

DOC = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
REWARD_FN = "length"  # the name a per-reward-function metric gets (its function's __name__)


def documented() -> dict[str, set[str]]:
    """``### Metrics: <method>`` headings -> the backticked names in the table's first column."""
    tables: dict[str, set[str]] = {}
    method = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"### Metrics: (.+)", line)
        if heading:
            method = heading.group(1).strip()
            tables[method] = set()
        elif line.startswith("#"):
            method = None
        elif method and line.startswith("| `"):
            name = line.split("|")[1].strip().strip("`")
            tables[method].add(name.replace("<func>", REWARD_FN))
    return tables


def length(prompts, completions, **kwargs):
    return [float(len(c)) / 8 for c in completions]


def _offline(name, tiny_dir, tokenizer):
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ref = build_model(seed=1, vocab_size=policy.config.vocab_size).eval()
    pad = tokenizer.pad_token_id
    pairs = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(4, seed=5)]
    batch = PreferenceCollator(pad)(pairs)
    if name == "SFT":
        rows = [tokenize_sft(r, tokenizer, max_length=64) for r in reverse_rows(4, seed=3)]
        return SFTLoss()(policy, SFTCollator(pad)(rows))[1]
    if name == "KTO":
        rows = [tokenize_kto(r, tokenizer, max_length=64) for r in kto_rows(6, seed=6)]
        return KTOLoss(ref_model=ref)(policy, KTOCollator(pad)(rows))[1]
    if name == "Reward model":
        model = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
        return RewardModelLoss()(model, batch)[1]
    loss_fn = {
        "DPO": lambda: DPOLoss(ref_model=ref),
        "IPO": lambda: IPOLoss(ref_model=ref),
        "SimPO": SimPOLoss,
        "CPO": CPOLoss,
        "ORPO": ORPOLoss,
    }[name]()
    return loss_fn(policy, batch)[1]


def _online(name, tiny_dir, tokenizer):
    torch.manual_seed(0)
    common = dict(num_generations=3, max_new_tokens=4)
    method = {
        "GRPO": lambda: GRPOMethod([length], beta=0.1, ref_model="copy", **common),
        "RLOO": lambda: RLOOMethod([length], beta=0.1, ref_model="copy", **common),
        "Online DPO": lambda: OnlineDPOMethod([length], ref_model="copy", **common),
        "RAFT": lambda: RAFTMethod([length], **common),
        "Distill": lambda: DistillMethod(
            AutoModelForCausalLM.from_pretrained(tiny_dir), reward_funcs=[length], **common
        ),
    }[name]()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rows = [tokenize_grpo(r, tokenizer, max_length=64) for r in reverse_rows(4, seed=11)]
    ctx = method_context(method, model, tokenizer, rows)
    prompts = GRPOCollator(tokenizer.pad_token_id)(rows[:2])
    batches, rollout_metrics, _ = build_rollouts(method, ctx).step(ctx, [(prompts, 1.0)])
    _, loss_metrics = method(model, batches[0][0])
    return {**rollout_metrics, **loss_metrics}


OFFLINE = ["SFT", "DPO", "IPO", "SimPO", "CPO", "ORPO", "KTO", "Reward model"]
ONLINE = ["GRPO", "RLOO", "Online DPO", "RAFT", "Distill"]


def test_every_method_has_a_metrics_table():
    assert set(documented()) == set(OFFLINE + ONLINE)
    assert all(documented().values())


@pytest.mark.parametrize("name", OFFLINE + ONLINE)
def test_logged_metric_names_equal_the_documented_table(name, tiny_dir, tokenizer):
    run = _offline if name in OFFLINE else _online
    logged = set(run(name, tiny_dir, tokenizer))
    assert logged == documented()[name], (
        f"{name}: logged but not documented {sorted(logged - documented()[name])}, "
        f"documented but not logged {sorted(documented()[name] - logged)}"
    )
