"""grimoire-rl 2.1.3 code that meets Grimoire's Python API: ``grimoire.registry``, ``except
ValueError`` around bad input, ``GRPOMethod(fused=...)``, ORPO / KTO metric names, and prompt rows
tokenized by grimoire-rl's ``tokenize_grpo`` (``input_ids`` / ``attention_mask``).

Each expectation comes from grimoire-rl's own behaviour (its sources, read from its sdist), worked
here by hand or by a naive re-implementation inside the test.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
import yaml
from tests.helpers.train_utils import params_of, quiet_config

import grimoire.data
from grimoire import GrimoireTrainer
from grimoire.collate.kto import KTOCollator
from grimoire.collate.preference import PreferenceCollator
from grimoire.errors import ConfigError, DataError
from grimoire.losses import GRPOMethod, KTOLoss, ORPOLoss, RAFTMethod, RLOOMethod
from grimoire.model.tiny import build_model, kto_rows, preference_rows, reverse_rows
from grimoire.rows.kto import tokenize_kto
from grimoire.rows.preference import tokenize_preference
from grimoire.rows.prompts import tokenize_grpo

# ------------------------------------------------------------------ grimoire.registry


def test_grimoire_registry_has_grimoire_rls_names():
    from grimoire import registry

    assert registry.get_loss_class("orpo").__name__ == "ORPOLoss"
    assert registry.get_loss_class("grimoire.losses.dpo:DPOLoss").__name__ == "DPOLoss"
    for name, cls in [("grpo", "GRPOMethod"), ("rloo", "RLOOMethod"), ("raft", "RAFTMethod")]:
        assert registry.get_loss_class(name).__name__ == cls
        assert name in registry.LOSSES
    assert registry.get_tokenize_fn("sft").__name__ == "tokenize_sft"
    assert registry.get_tokenize_fn("preference").__name__ == "tokenize_preference"
    # "prompt" is grimoire-rl's name for the online methods' tokenizer.
    assert registry.get_tokenize_fn("prompt") is registry.get_tokenize_fn("grpo")
    assert {"sft", "preference", "kto", "grpo", "prompt"} <= set(registry.TOKENIZERS)


def test_unknown_registry_name_is_a_keyerror_and_a_configerror():
    from grimoire import registry

    with pytest.raises(KeyError, match="unknown loss 'frobnicate_v9'") as err:
        registry.get_loss_class("frobnicate_v9")
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ValueError)
    assert "known: " in str(err.value) and not str(err.value).startswith("'")
    with pytest.raises(KeyError, match="unknown tokenize 'prefrence'.*did you mean"):
        registry.get_tokenize_fn("prefrence")


def test_grimoire_rls_module_paths_export_its_names():
    # grimoire.registry and grimoire.data.<module> are thin modules over grimoire.compat; each
    # exports what grimoire-rl's module of that path held, the same objects as Grimoire's own.
    from grimoire import registry
    from grimoire.compat import grimoire_rl_data, grimoire_rl_registry

    assert registry.get_loss_class is grimoire_rl_registry.get_loss_class
    assert registry.UnknownNameError is grimoire_rl_registry.UnknownNameError
    for path, names in grimoire_rl_data.MODULES.items():
        module = importlib.import_module(path)
        assert sorted(module.__all__) == sorted(names), path
        for name in names:
            assert getattr(module, name) is getattr(grimoire.data, name), (path, name)


# ------------------------------------------------------------------ ValueError


def test_config_and_data_errors_are_value_errors_with_one_message():
    for cls, title in [(ConfigError, "invalid configuration"), (DataError, "invalid data")]:
        try:
            raise cls(["first problem", "second problem"])
        except ValueError as caught:  # what grimoire-rl users write
            assert str(caught) == f"{title} (2):\n  - first problem\n  - second problem"


# ------------------------------------------------------------------ GRPOMethod(fused=...)


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def _naive_completion_logps(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(completion)]


@pytest.mark.parametrize("fused", [True, False])
def test_online_methods_take_fused_and_use_it_for_training_logps(monkeypatch, fused):
    from grimoire.forward import completions

    for cls in (GRPOMethod, RLOOMethod, RAFTMethod):
        method = cls([length_reward], fused=fused, fused_chunk_size=7, num_generations=2)
        assert (method.fused, method.fused_chunk_size) == (fused, 7)
    method = GRPOMethod([length_reward], fused=fused, fused_chunk_size=7, num_generations=2)
    seen = []
    real = completions.compute_token_logps

    def spy(*args, **kwargs):
        seen.append((kwargs["fused"], kwargs["chunk_size"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(completions, "compute_token_logps", spy)
    model = build_model(seed=0).eval()
    # Two rows: [left-padded prompt | right-padded completion], as a rollout lays them out.
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11, 12], [13]]
    ids = torch.tensor([[5, 6, 7, 10, 11, 12], [0, 8, 9, 13, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": mask[:, 3:]}
    logps, _ = method.policy_logps(model, batch)
    assert seen == [(fused, 7)]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        got = logps[i, : len(c)].tolist()
        assert got == pytest.approx(_naive_completion_logps(model, p, c), abs=1e-5)
        assert logps[i, len(c) :].abs().sum() == 0


def test_online_method_refuses_a_bad_fused_chunk_size():
    with pytest.raises(ValueError, match="fused_chunk_size must be > 0"):
        GRPOMethod([length_reward], fused_chunk_size=0)


# ------------------------------------------------------------------ ORPO / KTO metric names


def test_orpo_logs_grimoire_rl_metric_names_with_its_values(tokenizer):
    policy = build_model(seed=0).eval()
    rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(4, seed=5)]
    batch = PreferenceCollator(tokenizer.pad_token_id)(rows)
    _, metrics = ORPOLoss(beta=0.25)(policy, batch)

    # grimoire-rl's definitions, by hand: average log-prob of each response's trained tokens.
    def avg_logp(ids, labels):
        with torch.no_grad():
            lp = torch.log_softmax(policy(ids[None]).logits[0].float(), -1)
        t = [i for i in range(1, len(ids)) if labels[i] != -100]
        return sum(float(lp[i - 1, ids[i]]) for i in t) / len(t)

    chosen = [avg_logp(batch["chosen_input_ids"][i], batch["chosen_labels"][i]) for i in range(4)]
    rejected = [
        avg_logp(batch["rejected_input_ids"][i], batch["rejected_labels"][i]) for i in range(4)
    ]
    expect = {
        "chosen_rewards": 0.25 * sum(chosen) / 4,
        "rejected_rewards": 0.25 * sum(rejected) / 4,
        "reward_margin": 0.25 * (sum(chosen) - sum(rejected)) / 4,
        "reward_accuracy": sum(c > r for c, r in zip(chosen, rejected)) / 4,
    }
    got = {k: float(metrics[k]) for k in expect}
    assert got == pytest.approx(expect, abs=1e-5)


def test_kto_logs_grimoire_rl_metric_names_with_its_values(tokenizer):
    policy, ref = build_model(seed=0).eval(), build_model(seed=1).eval()
    raw = kto_rows(6, seed=6)
    rows = [tokenize_kto(r, tokenizer, max_length=64) for r in raw]
    batch = KTOCollator(tokenizer.pad_token_id)(rows)
    _, metrics = KTOLoss(beta=0.5, ref_model=ref)(policy, batch)

    def seq_logp(model, ids, labels):
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        return sum(float(lp[i - 1, ids[i]]) for i in range(1, len(ids)) if labels[i] != -100)

    rewards, labels = [], [bool(r["label"]) for r in raw]
    for i in range(6):
        ids, lab = batch["input_ids"][i], batch["labels"][i]
        rewards.append(0.5 * (seq_logp(policy, ids, lab) - seq_logp(ref, ids, lab)))
    good = [r for r, y in zip(rewards, labels) if y]
    bad = [r for r, y in zip(rewards, labels) if not y]
    assert good and bad
    expect = {
        "chosen_rewards": sum(good) / len(good),
        "rejected_rewards": sum(bad) / len(bad),
        "reward_margin": sum(good) / len(good) - sum(bad) / len(bad),
        # grimoire-rl: desirable rows right when reward > 0, undesirable when < 0.
        "reward_accuracy": (sum(r > 0 for r in good) + sum(r < 0 for r in bad)) / 6,
        "kl_ref": float(metrics["kl"]),
    }
    got = {k: float(metrics[k]) for k in expect}
    assert got == pytest.approx(expect, abs=1e-4)
    assert float(metrics["reward_accuracy"]) == float(metrics["rewards/accuracies"])


# ------------------------------------------------------------------ grimoire-rl prompt rows


def peer_tokenize_grpo(example, tokenizer, metadata_fields):
    """grimoire-rl 2.1.3's ``tokenize_grpo``, re-implemented from its source: the prompt as
    ``input_ids`` / ``attention_mask``, the metadata columns copied, no prompt text."""
    tokens = tokenizer(example["prompt"], max_length=512, truncation=True)
    out = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}
    out.update({name: example[name] for name in metadata_fields})
    return out


def _train_grpo(tiny_dir, tokenizer, rows, out, seen_prompts):
    from transformers import AutoModelForCausalLM

    def answer_reward(prompts, completions, answer, **kwargs):
        seen_prompts.extend(prompts)
        return [float(c.startswith(a[:1])) + len(c) / 10 for c, a in zip(completions, answer)]

    torch.manual_seed(0)
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer=tokenizer,
        config=quiet_config(out, max_steps=2, batch_size=2, seed=0),
        loss_fn=GRPOMethod([answer_reward], num_generations=2, max_new_tokens=4),
        train_dataset=rows,
    )
    trainer.train()
    return params_of(trainer.model)


def test_grpo_trains_from_grimoire_rl_tokenized_rows_saved_to_disk(tiny_dir, tokenizer, tmp_path):
    from datasets import Dataset, load_from_disk

    raw = reverse_rows(4, seed=2)
    ours = [tokenize_grpo(r, tokenizer, max_length=64, metadata_fields=["answer"]) for r in raw]
    peer = Dataset.from_list([peer_tokenize_grpo(r, tokenizer, ["answer"]) for r in raw])
    peer.save_to_disk(str(tmp_path / "peer"))
    peer = load_from_disk(str(tmp_path / "peer"))
    assert sorted(peer.column_names) == ["answer", "attention_mask", "input_ids"]

    ours_prompts, peer_prompts = [], []
    want = _train_grpo(tiny_dir, tokenizer, ours, tmp_path / "a", ours_prompts)
    got = _train_grpo(tiny_dir, tokenizer, peer, tmp_path / "b", peer_prompts)
    # Same prompts, same samples, same rewards: the same weights after two steps.
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    # The reward functions got grimoire-rl's prompt text: the ids decoded without special tokens.
    assert peer_prompts == ours_prompts and set(peer_prompts) <= {r["prompt"] for r in raw}


def test_cli_trains_grpo_from_grimoire_rl_rows_saved_to_disk(tokenizer, tmp_path, monkeypatch):
    from datasets import Dataset

    from grimoire.cli.main import main

    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the config's folder on it
    rows = [peer_tokenize_grpo(r, tokenizer, ["answer"]) for r in reverse_rows(4, seed=2)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "peer"))
    config = {
        "model": {"pretrained": "tiny:llama"},
        "dataset": {"path": str(tmp_path / "peer")},  # no tokenize section: the rows are ready
        "loss": {
            "type": "grpo",
            "args": {"reward_funcs": ["exact_match"], "num_generations": 2, "max_new_tokens": 4},
        },
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "batch_size": 2},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(path)]) == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/mean" in r for r in records)
