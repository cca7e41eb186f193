"""One step of SFT, DPO and GRPO on the real SmolLM2-135M-Instruct, its greedy sampling against
transformers' ``generate``, and the CLI's train -> save -> plain ``from_pretrained`` ->
``grimoire generate`` on it. Each against a reference computed here; ``pytest -k real_model``."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tests.helpers.commands import grimoire_command, run
from tests.helpers.real_model import SMOLLM2
from tests.helpers.train_utils import RecordLosses, params_of, quiet_config, train
from transformers import AutoModelForCausalLM

from grimoire.data import tokenize_preference, tokenize_sft
from grimoire.losses import DPOLoss, GRPOMethod, SFTLoss
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rows.prompts import tokenize_grpo

SUMS = [(23, 45), (61, 17), (38, 29), (54, 33)]


def _chat(a: int, b: int, answer: str | None = None) -> list[dict[str, str]]:
    user = {"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}
    return [user] if answer is None else [user, {"role": "assistant", "content": answer}]


def _changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> int:
    return sum(not torch.equal(before[k], v) for k, v in model.named_parameters())


def test_real_model_sft_step_loss_is_the_assistant_token_mean(real_model, real_tokenizer, tmp_path):
    rows = [
        tokenize_sft({"messages": _chat(a, b, str(a + b))}, real_tokenizer, max_length=128)
        for a, b in SUMS
    ]
    with torch.no_grad():  # naive: each row's full logits, summed CE over labels / all labels
        nll, count = 0.0, 0
        for row in rows:
            logits = real_model(torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            nll += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    before, record = params_of(real_model), RecordLosses()
    config = quiet_config(tmp_path, max_steps=1, batch_size=4, learning_rate=1e-5)
    train(real_model, real_tokenizer, rows, SFTLoss(), config, callbacks=[record])
    assert record.losses[0] == pytest.approx(nll / count, rel=1e-4)
    assert _changed(before, real_model) > 200


def test_real_model_dpo_starts_at_log_two_and_moves_towards_chosen(
    real_model, real_tokenizer, tmp_path
):
    rows = [
        tokenize_preference(
            {"prompt": _chat(a, b), "chosen": [_reply(a + b)], "rejected": [_reply(a + b + 10)]},
            real_tokenizer,
            max_length=128,
        )
        for a, b in SUMS
    ]
    record = RecordLosses()
    config = quiet_config(tmp_path, max_steps=3, batch_size=4, learning_rate=1e-5)
    train(real_model, real_tokenizer, rows, DPOLoss(ref_model="copy"), config, callbacks=[record])
    # policy == reference at step 1: every pair's margin is 0 and -log sigmoid(0) = log 2
    assert record.losses[0] == pytest.approx(math.log(2), rel=1e-5)
    assert record.losses[-1] < math.log(2) - 1e-3  # the same 4 pairs, three steps on


def test_real_model_grpo_step_samples_scores_and_updates(real_model, real_tokenizer, tmp_path):
    def shorter(completion_ids, **kwargs):  # TRL's keyword; varies within a group (advantages)
        return [-len(ids) / 12 for ids in completion_ids]

    rows = [tokenize_grpo({"prompt": _chat(a, b)}, real_tokenizer, max_length=128) for a, b in SUMS]
    method = GRPOMethod([shorter], num_generations=4, max_new_tokens=12, temperature=1.0)
    before, record = params_of(real_model), RecordLosses()
    config = quiet_config(tmp_path, max_steps=1, batch_size=2, learning_rate=1e-5)
    train(real_model, real_tokenizer, rows, method, config, callbacks=[record])
    metrics = record.records[0]
    assert math.isfinite(metrics["loss"])
    assert -1 - 1e-6 <= metrics["reward"] <= -1 / 12 + 1e-6  # 1..12 sampled tokens
    assert _changed(before, real_model) > 200


def test_real_model_engine_greedy_equals_transformers_generate(real_model, real_tokenizer):
    """Left-padded prompts of different lengths, a shared prefill and a static cache, against
    transformers' ``generate`` one prompt at a time."""
    chats = [_chat(3, 4), _chat(61, 17), [{"role": "user", "content": "Name a colour."}]]
    prompts = [
        real_tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for c in chats
    ]
    engine = HFGenerateEngine(max_new_tokens=10)
    engine.bind(real_model, real_tokenizer.pad_token_id, real_tokenizer.eos_token_id)
    rollout = engine.generate(prompts, 1, greedy=True, with_old_logps=False)
    for i, prompt in enumerate(prompts):
        out = real_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=2
        )
        want = out[0, len(prompt) :].tolist()
        got = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        assert got == want[: len(got)] and len(got) == len(want)


def test_real_model_cli_trains_saves_reloads_and_generates(real_model_cache, tmp_path):
    root, base_dir, _ = real_model_cache
    (tmp_path / "train.jsonl").write_text(
        "\n".join(json.dumps({"messages": _chat(a, b, str(a + b))}) for a, b in SUMS)
    )
    (tmp_path / "run.yaml").write_text(
        f"model:\n  pretrained: {SMOLLM2}\n"
        "dataset:\n  jsonl: train.jsonl\n"
        "training:\n  output_dir: out\n  max_steps: 1\n  batch_size: 4\n"
        "  learning_rate: 1.0e-5\n  mixed_precision: 'no'\n"
        "save_to: out/final\n"
    )
    env = {"GRIMOIRE_CACHE": str(root)}  # the session's converted folder: no second conversion
    done = run([*grimoire_command(), "train", "--config", "run.yaml"], tmp_path, **env)
    assert "converting" not in done.stderr
    final = tmp_path / "out" / "final"
    trained = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert _changed(params_of(base), trained) > 200
    prompt = "What is 12 + 30? Answer with the number only."
    shown = run(
        [*grimoire_command(), "generate", "--model", str(final), "--prompt", prompt, "--chat"],
        tmp_path,
        **env,
    ).stdout
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = trained.generate(**ids, max_new_tokens=64, do_sample=False)
    want = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert want and want in shown


def _reply(n: int) -> dict[str, str]:
    return {"role": "assistant", "content": str(n)}
