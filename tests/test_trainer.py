"""The training loop: gradient-accumulation parity, exact resume, checkpoints, stop, LoRA."""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.train_utils import RecordLosses, params_of, quiet_config, train
from transformers import AutoModelForCausalLM

from grimoire import GrimoireTrainer, TrainerCallback
from grimoire.losses import SFTLoss
from grimoire.optim.optimizers import no_decay_names
from grimoire.training.checkpoint import list_checkpoints


def _naive_sgd_step(model, rows, lr):
    """Reference: one SGD step on the token-mean NLL of all ``rows`` at once (HF's own loss)."""
    from grimoire.data import SFTCollator

    batch = SFTCollator(pad_token_id=0)(rows)
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return params_of(model)


def test_grad_accumulation_matches_one_big_batch(tiny_dir, tokenizer, sft_rows, tmp_path):
    rows = sft_rows[:8]
    assert len({len(r["input_ids"]) for r in rows}) > 2, "rows must differ in length"
    common = dict(
        optimizer="sgd", learning_rate=0.5, weight_decay=0.0, max_grad_norm=None, max_steps=1
    )
    big = train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "a", batch_size=8, **common),
    )
    acc = train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "b", batch_size=2, gradient_accumulation_steps=4, **common),
    )
    # The planner draws the same permutation for both: one global batch of all 8 rows.
    ref = _naive_sgd_step(AutoModelForCausalLM.from_pretrained(tiny_dir), rows, lr=0.5)
    before = params_of(AutoModelForCausalLM.from_pretrained(tiny_dir))
    moved = 0.0
    for name, p in acc.unwrapped_model.named_parameters():
        torch.testing.assert_close(p, big.unwrapped_model.get_parameter(name), atol=2e-6, rtol=0)
        torch.testing.assert_close(p, ref[name], atol=2e-6, rtol=0)
        moved = max(moved, float((p - before[name]).abs().max()))
    assert moved > 1e-3, "the step must actually change parameters"


def test_per_microbatch_mean_would_differ(tiny_dir, sft_rows):
    """Sanity: with these rows, averaging micro-batch means is a different objective, so the
    parity test above can fail if normalisation is wrong."""
    from grimoire.data import SFTCollator

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rows = sft_rows[:8]
    col = SFTCollator(0)
    micro = [SFTLoss()(model, col(rows[i : i + 2]))[0] for i in range(0, 8, 2)]
    whole = SFTLoss()(model, col(rows))[0]
    assert abs(float(sum(micro) / 4) - float(whole)) > 1e-4


def test_resume_mid_epoch_reproduces_uninterrupted_run(tiny_dir, tokenizer, sft_rows, tmp_path):
    def model():
        # Dropout on, so the RNG state in the checkpoint matters.
        m = AutoModelForCausalLM.from_pretrained(tiny_dir, attention_dropout=0.2)
        return m

    rows = sft_rows[:40]  # 10 steps per epoch at batch 4: step 3 is mid-epoch
    cfg = dict(max_steps=7, learning_rate=3e-3, lr_scheduler="cosine", warmup_steps=2)
    full_log = RecordLosses()
    train(
        model(),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "full", **cfg),
        callbacks=[full_log],
    )

    first = RecordLosses()
    train(
        model(),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "part", save_steps=3, **{**cfg, "max_steps": 7}),
        callbacks=[first, _StopAt(3)],
    )
    assert (tmp_path / "part" / "checkpoint-3").is_dir()
    resumed_log = RecordLosses()
    resumed = train(
        model(),
        tokenizer,
        rows,
        SFTLoss(),
        quiet_config(tmp_path / "part", resume_from_checkpoint="latest", **cfg),
        callbacks=[resumed_log],
    )
    assert first.losses == full_log.losses[:3]
    assert resumed_log.losses == full_log.losses[3:]  # bit-exact, not just close
    assert resumed.global_step == 7


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step, loss, metrics):
        if step >= self.step:
            trainer.request_stop()


def test_request_stop_and_metrics_log(tiny_model, tokenizer, sft_rows, tmp_path):
    trainer = train(
        tiny_model,
        tokenizer,
        sft_rows,
        SFTLoss(),
        quiet_config(tmp_path, max_steps=50),
        callbacks=[_StopAt(2)],
    )
    assert trainer.global_step == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in (
        "step",
        "epoch",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "tokens_per_sec",
        "elapsed",
        "peak_memory_mb",
    ):
        assert key in records[0]
    assert records[1]["tokens"] > records[0]["tokens"] > 0


def test_checkpoints_rotate_atomically_and_load(tiny_model, tokenizer, sft_rows, tmp_path):
    hooks = []

    class OnSave(TrainerCallback):
        def on_save(self, trainer, checkpoint_dir):
            hooks.append(checkpoint_dir)

    train(
        tiny_model,
        tokenizer,
        sft_rows[:16],
        SFTLoss(),
        quiet_config(
            tmp_path, num_epochs=2, save_steps=2, save_total_limit=2, save_on_epoch_end=True
        ),
        callbacks=[OnSave()],
    )
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["checkpoint-6", "checkpoint-8"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert len(hooks) >= 4
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-8")
    state = json.loads((tmp_path / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["epoch"] == 2 and state["step_in_epoch"] == 0
    assert loaded.config.vocab_size == tiny_model.config.vocab_size


def test_weight_decay_excludes_biases_and_all_norms():
    from grimoire.model.tiny import build_model

    model = build_model("qwen2", vocab_size=64)  # qwen2 has q/k/v biases and RMSNorms
    skip = no_decay_names(model)
    norms = {n for n, _ in model.named_parameters() if "norm" in n}
    biases = {n for n, _ in model.named_parameters() if n.endswith("bias")}
    assert norms and biases
    assert norms | biases == skip
    assert "model.layers.0.self_attn.q_proj.weight" not in skip


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedulers(kind):
    from grimoire.config.training import TrainingConfig
    from grimoire.optim.optimizers import build_scheduler

    cfg = TrainingConfig(lr_scheduler=kind, warmup_steps=4, learning_rate=1.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, cfg, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    if kind == "constant":
        assert lrs == [1.0] * 20
        return
    assert lrs[0] < lrs[1] < lrs[3] < 1.0 and lrs[4] == 1.0  # linear warmup over 4 steps
    if kind == "constant_with_warmup":
        assert lrs[4:] == [1.0] * 16
    else:
        assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] < 0.1
    if kind == "cosine":
        import math

        assert lrs[12] == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 16)))


def test_lora_trains_only_adapters_and_saves_both_ways(tiny_model, tokenizer, sft_rows, tmp_path):
    from peft import LoraConfig

    before = params_of(tiny_model)
    trainer = train(
        tiny_model,
        tokenizer,
        sft_rows[:8],
        SFTLoss(),
        quiet_config(tmp_path, max_steps=2, learning_rate=1e-2),
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        ),
    )
    base = trainer.unwrapped_model.get_base_model()
    for name, p in base.named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(p, before[name.replace(".base_layer", "")])
    adapter_dir = trainer.save_model(tmp_path / "adapter")
    assert (adapter_dir / "adapter_model.safetensors").exists()
    merged_dir = trainer.save_model(tmp_path / "merged", merge_adapter=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    ids = torch.tensor([sft_rows[0]["input_ids"]])
    with torch.no_grad():
        want = trainer.unwrapped_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_on_cpu_and_checkpointing_parity(tiny_dir, tokenizer, sft_rows, tmp_path):
    seen = {}

    class Probe(SFTLoss):
        def __call__(self, model, batch, training=True):
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            seen["dtype"] = torch.get_autocast_dtype("cpu")
            return super().__call__(model, batch, training)

    train(
        AutoModelForCausalLM.from_pretrained(tiny_dir),
        tokenizer,
        sft_rows[:4],
        Probe(),
        quiet_config(tmp_path / "bf16", max_steps=1, mixed_precision="bf16"),
    )
    assert seen == {"autocast": True, "dtype": torch.bfloat16}

    logs = []
    for gc in (False, True):
        rec = RecordLosses()
        train(
            AutoModelForCausalLM.from_pretrained(tiny_dir),
            tokenizer,
            sft_rows[:8],
            SFTLoss(),
            quiet_config(tmp_path / f"gc{gc}", max_steps=2, gradient_checkpointing=gc),
            callbacks=[rec],
        )
        logs.append(rec.losses)
    assert logs[0] == pytest.approx(logs[1], abs=1e-6)


def test_disable_dropout_zeroes_every_dropout(tiny_dir, tokenizer, sft_rows, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attention_dropout=0.3)
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tokenizer,
        loss_fn=SFTLoss(),
        train_dataset=sft_rows[:4],
        config=quiet_config(tmp_path, disable_dropout=True),
    )
    m = trainer.unwrapped_model
    assert m.config.attention_dropout == 0.0
    assert all(getattr(mod, "attention_dropout", 0.0) == 0.0 for mod in m.modules())


def test_refuses_to_train_alone_under_a_multi_process_launch(monkeypatch):
    from grimoire.parallel.accelerate import check_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"PartialState\(cpu=True\)"):
        check_world_size(1)
    # 2 processes, but no process group: an earlier trainer's close() released it (a real
    # 2-process launch builds a trainer after close() in tests/test_distributed.py).
    with pytest.raises(RuntimeError, match=r"call close\(\) only on the last trainer"):
        check_world_size(2)
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    check_world_size(2)  # a 2-process group passes
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_world_size(1)


def test_dataloader_workers_collate_and_the_main_process_moves(
    tiny_dir, tokenizer, sft_rows, tmp_path, monkeypatch
):
    """With 2 DataLoader workers the run is the same as without, and every device move happens
    in the main process (a worker touching CUDA would fail)."""
    import os

    moves = tmp_path / "moves.txt"
    original = GrimoireTrainer._to_device

    def recording(self, batch):
        with moves.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return original(self, batch)

    monkeypatch.setattr(GrimoireTrainer, "_to_device", recording)
    logs = []
    for workers in (0, 2):
        record = RecordLosses()
        train(
            AutoModelForCausalLM.from_pretrained(tiny_dir),
            tokenizer,
            sft_rows[:24],
            SFTLoss(),
            quiet_config(tmp_path / str(workers), max_steps=3, dataloader_num_workers=workers),
            callbacks=[record],
        )
        logs.append(record.losses)
    assert logs[0] == logs[1]
    pids = moves.read_text().split()
    assert len(pids) == 2 * 3 and set(pids) == {str(os.getpid())}
