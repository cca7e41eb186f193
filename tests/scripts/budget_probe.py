"""Train each method family under a small token budget and record every forward pass.

A forward pre-hook on the model's decoder (policy and reference alike) records what each pass
really holds: ``rows x (cached + new positions)`` tokens, padding included, for training,
reference, old-policy, scoring and generation passes. A gradient hook on the decoder's output
records which samples of a pass received gradient, i.e. were trained (rank-sync dummy passes
run with loss weight 0 and receive none). Nothing here reads the planner's own output.

Usage: ``python budget_probe.py TINY_DIR OUT_DIR FAMILY[,FAMILY...]`` (also under a launcher);
writes ``OUT_DIR/<family>.rank<r>.json`` (``OUT_DIR/<mode>/...`` for each of several
``PROBE_DISTRIBUTED`` modes). Tests import :data:`FAMILIES` for the expectations.
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch

IGNORE = -100
LOW, HIGH = 4, 64  # token ids used for synthetic rows (0-3 are special in the tiny tokenizer)


def _seqs(n: int, lengths: list[int], seed: int) -> list[list[int]]:
    """``n`` random sequences with lengths drawn from ``lengths`` and distinct first tokens, so
    none is a prefix of another and a (possibly cut) sample names its row unambiguously."""
    rng = random.Random(seed)
    firsts = rng.sample(range(LOW, HIGH), n)
    return [
        [f] + [rng.randrange(LOW, HIGH) for _ in range(rng.choice(lengths) - 1)] for f in firsts
    ]


# Long-tailed: mostly short, a few near the budget.
TAIL = [3, 4, 4, 5, 5, 6, 7, 8, 10, 12, 16, 22, 30]


def sft_rows(n: int = 28) -> list[dict[str, Any]]:
    rows = []
    for s in _seqs(n, [x * 2 for x in TAIL], seed=1):
        k = max(1, len(s) // 3)
        rows.append({"input_ids": s, "labels": [IGNORE] * k + s[k:]})
    return rows


def pair_rows(n: int = 20) -> list[dict[str, Any]]:
    rows = []
    rng = random.Random(2)
    for prompt in _seqs(n, [2, 3, 4, 6, 8], seed=3):
        sides = {}
        for side, first in (("chosen_", LOW), ("rejected_", LOW + 1)):
            resp = [first] + [rng.randrange(LOW, HIGH) for _ in range(rng.choice(TAIL))]
            ids = prompt + resp
            sides[f"{side}input_ids"] = ids
            sides[f"{side}attention_mask"] = [1] * len(ids)
            sides[f"{side}labels"] = [IGNORE] * len(prompt) + resp
        rows.append(sides)
    return rows


def kto_rows(n: int = 24) -> list[dict[str, Any]]:
    rows = []
    for i, s in enumerate(_seqs(n, TAIL, seed=4)):
        k = max(1, min(3, len(s) - 1))
        rows.append(
            {
                "input_ids": s,
                "attention_mask": [1] * len(s),
                "labels": [IGNORE] * k + s[k:],
                "label": i % 2 == 0,
            }
        )
    return rows


def prompt_rows(n: int = 12) -> list[dict[str, Any]]:
    return [
        {"prompt_input_ids": s, "prompt_attention_mask": [1] * len(s), "prompt": f"p{i}"}
        for i, s in enumerate(_seqs(n, [2, 3, 4, 5, 8, 12], seed=5))
    ]


def content_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Distinct per completion (no all-equal groups, so every sample gets gradient)."""
    return [len(c) + (sum(map(ord, c)) % 97) / 97 for c in completions]


def _ref(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).eval()


#: family -> (budget, training overrides). Budgets are small against the rows above.
FAMILIES: dict[str, dict[str, Any]] = {
    "sft": {"budget": 64},
    "sft_osft": {"budget": 64, "osft": True, "osft_unfreeze_rank_ratio": 0.5},
    "dpo_truncate": {"budget": 25, "truncate_long_samples": True},
    "orpo": {"budget": 72},
    "kto": {"budget": 64},
    "reward": {"budget": 96},
    "grpo": {"budget": 80},
    "online_dpo": {"budget": 80},
}
G, MAX_NEW = 4, 6


def build(family: str, tiny_dir: str) -> tuple[Any, Any, list[dict[str, Any]], list]:
    """``(model, loss, rows, extra models to probe)`` for ``family``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from grimoire.losses import DPOLoss, KTOLoss, ORPOLoss, RewardModelLoss, SFTLoss
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.losses.online_dpo import OnlineDPOMethod

    torch.manual_seed(0)
    if family == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
        return model, RewardModelLoss(), pair_rows(), []
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    if family.startswith("sft"):
        return model, SFTLoss(), sft_rows(), []
    if family == "dpo_truncate":
        ref = _ref(model)
        return model, DPOLoss(ref_model=ref), pair_rows(), [ref]
    if family == "orpo":
        return model, ORPOLoss(), pair_rows(), []
    if family == "kto":
        ref = _ref(model)
        return model, KTOLoss(ref_model=ref), kto_rows(), [ref]
    common = dict(
        reward_funcs=content_reward, num_generations=G, max_new_tokens=MAX_NEW, ref_model=None
    )
    if family == "grpo":
        ref = _ref(model)
        # beta > 0: a reference pass; num_iterations 2: an old-policy (scoring) pass.
        method = GRPOMethod(**{**common, "ref_model": ref}, beta=0.04, num_iterations=2)
        return model, method, prompt_rows(), [ref]
    if family == "online_dpo":
        ref = _ref(model)
        return model, OnlineDPOMethod(**{**common, "ref_model": ref}), prompt_rows(), [ref]
    raise ValueError(family)


class Probe:
    """Records every decoder pass of the probed models (see the module docstring)."""

    def __init__(self) -> None:
        self.passes: list[dict[str, Any]] = []

    def attach(self, model: torch.nn.Module, tag: str) -> None:
        decoder = model.model  # LlamaModel under *ForCausalLM / *ForSequenceClassification
        decoder.register_forward_pre_hook(self._pre(tag), with_kwargs=True)
        decoder.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, tag: str):
        def hook(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            past = kwargs.get("past_key_values")
            cached = int(past.get_seq_length()) if past is not None else 0
            rows, width = ids.shape
            record = {
                "tag": tag,
                "tokens": rows * (cached + width),
                "grad": torch.is_grad_enabled(),
                "samples": _samples(ids, kwargs),
                "trained": None,
            }
            self.passes.append(record)

        return hook

    def _post(self, _module, _args, kwargs, output):
        record = self.passes[-1]
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        if not hidden.requires_grad:
            return
        spans = record["spans"] = [(r, a, b) for r, a, b, _ in record["samples"]]

        def on_grad(grad: torch.Tensor) -> None:
            norm = grad.detach().abs().sum(-1)
            record["trained"] = [bool(norm[r, a:b].any()) for r, a, b in spans]

        hidden.register_hook(on_grad)

    def dump(self) -> list[dict[str, Any]]:
        out = []
        for p in self.passes:
            trained = p["trained"] or [False] * len(p["samples"])
            out.append(
                {
                    "tag": p["tag"],
                    "tokens": p["tokens"],
                    "grad": p["grad"],
                    "trained": [s[3] for s, t in zip(p["samples"], trained) if t],
                }
            )
        return out


def _samples(ids: torch.Tensor, kwargs: dict[str, Any]) -> list[tuple[int, int, int, list[int]]]:
    """``(row, start, end, tokens)`` per sample: packed rows split where positions restart,
    padded rows cut to their attention mask."""
    pos, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    out = []
    for r in range(ids.shape[0]):
        row = ids[r].tolist()
        if mask is not None and mask.dim() == 2 and mask.shape == ids.shape:
            keep = mask[r].nonzero().flatten().tolist()
            if keep:
                out.append((r, keep[0], keep[-1] + 1, [row[i] for i in keep]))
            continue
        if pos is not None and ids.shape[0] == 1:
            starts = (pos[0] == 0).nonzero().flatten().tolist() + [len(row)]
            out += [(r, a, b, row[a:b]) for a, b in zip(starts, starts[1:]) if b > a]
            continue
        out.append((r, 0, len(row), row))
    return out


def expected_units(family: str) -> dict[tuple[int, ...], int]:
    """Each sequence one epoch must train, and how many times (online: per sampled completion
    that enters the loss: G per prompt and per policy iteration for GRPO, the chosen and the
    rejected completion for Online DPO)."""
    if family.startswith("sft"):
        return {tuple(r["input_ids"]): 1 for r in sft_rows()}
    if family in ("dpo_truncate", "orpo", "reward"):
        rows = pair_rows()
        return {tuple(r[f"{s}input_ids"]): 1 for r in rows for s in ("chosen_", "rejected_")}
    if family == "kto":
        return {tuple(r["input_ids"]): 1 for r in kto_rows()}
    per_prompt = G * 2 if family == "grpo" else 2
    return {tuple(r["prompt_input_ids"]): per_prompt for r in prompt_rows()}


def run(tiny_dir: str, out_dir: str, families: list[str], distributed: str = "ddp") -> Any:
    """Every family in turn; returns the last trainer (the caller closes it: closing releases
    the process group, which a later run in this process still needs)."""
    from tests.helpers.train_utils import quiet_config
    from transformers import AutoTokenizer

    from grimoire import GrimoireTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    trainer = None
    for family in families:
        spec = dict(FAMILIES[family])
        budget = spec.pop("budget")
        model, loss, rows, extra = build(family, tiny_dir)
        probe = Probe()
        probe.attach(model, "policy")
        for i, m in enumerate(extra):
            probe.attach(m, f"reference{i}")
        config = quiet_config(
            Path(out_dir) / family,
            batch_size=6,
            learning_rate=1e-4,
            disable_dropout=True,
            max_tokens_per_device=budget,
            distributed=distributed,
            **spec,
        )
        trainer = GrimoireTrainer(model, tokenizer, config, loss, rows)
        trainer.train()
        rank = trainer.accelerator.process_index
        result = {"budget": budget, "passes": probe.dump(), "steps": trainer.global_step}
        (Path(out_dir) / f"{family}.rank{rank}.json").write_text(json.dumps(result))
    return trainer


if __name__ == "__main__":
    # PROBE_DISTRIBUTED: "ddp", "fsdp2" or both ("ddp,fsdp2": each into OUT_DIR/<mode>/, one
    # launch for both).
    modes = os.environ.get("PROBE_DISTRIBUTED", "ddp").split(",")
    for mode in modes:
        out = str(Path(sys.argv[2], mode)) if len(modes) > 1 else sys.argv[2]
        trainer = run(sys.argv[1], out, sys.argv[3].split(","), mode)
    trainer.close()
