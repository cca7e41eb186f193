"""Asynchronous rollouts (``max_staleness: 1``, the process sampler) under 2 CPU processes
(gloo, ``accelerate launch``): one sampler process per rank; the rollout stage's collectives
(the step statistics' all-reduces in ``build_batches``) stay on each learner's thread.

The file is also the worker script: ``python test_async_ddp.py MODEL_DIR OUT_DIR STALENESS``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers.train_utils import gloo_launch
from tests.rollout.test_online_ddp import _env


def _launch(tiny_dir, out: Path, staleness: int) -> None:
    import subprocess

    subprocess.run(
        [*gloo_launch(2), __file__, str(tiny_dir), str(out), str(staleness)],
        check=True,
        env=_env(),
        timeout=400,
    )


def test_async_staleness_one_on_two_processes_runs_within_the_bound_per_rank(tiny_dir, tmp_path):
    _launch(tiny_dir, tmp_path, 1)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for record in ranks:
        assert record["world"] == 2 and len(record["staleness"]) == 4
        assert record["staleness"][0] == 0.0  # sampled by the starting weights
        assert all(0.0 <= s <= 1.0 for s in record["staleness"])  # the bound, per rank
        assert record["sampler_pids"] and not record["alive"]  # one child each, ended
    assert set(ranks[0]["sampler_pids"]).isdisjoint(ranks[1]["sampler_pids"])


def test_async_with_a_sharded_policy_is_refused_naming_the_key():
    from grimoire.rollout.async_rollouts import async_problems
    from grimoire.rollout.engines.hf import HFGenerateEngine

    key = "loss.args.max_staleness"
    assert async_problems(key, 1, HFGenerateEngine(), sharded=False) == []
    (problem,) = async_problems(key, 1, HFGenerateEngine(), sharded=True)
    assert problem.startswith(f"{key}=1 needs whole weights") and "fsdp2" in problem
    assert async_problems(key, 0, HFGenerateEngine(), sharded=True) == []  # sync: fine


def _worker(model_dir: str, out_dir: str, staleness: int) -> None:
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.model.tiny import reverse_rows
    from grimoire.rows.prompts import tokenize_grpo
    from grimoire.training.callbacks import TrainerCallback

    torch.set_num_threads(1)

    class Record(TrainerCallback):
        def __init__(self):
            self.staleness: list[float] = []
            self.pids: set[int] = set()

        def on_step_end(self, trainer, step, loss, metrics) -> None:
            self.staleness.append(metrics["staleness/max"])  # this rank's, before reduction
            if trainer.rollouts.sampler_process is not None:
                self.pids.add(trainer.rollouts.sampler_process.pid)

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(32, seed=5)]
    config = TrainingConfig(
        output_dir=out_dir,
        max_steps=4,
        batch_size=2,
        learning_rate=1e-2,
        seed=0,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        lr_scheduler="constant",
        warmup_ratio=0.0,
        disable_dropout=True,
    )
    method = GRPOMethod(
        ["char_match"], num_generations=4, max_new_tokens=6, max_staleness=staleness
    )
    record = Record()
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=rows,
        callbacks=[record],
    )
    trainer.train()
    trainer.close()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    rank = trainer.accelerator.process_index
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "world": trainer.accelerator.num_processes,
                "staleness": record.staleness,
                "sampler_pids": sorted(record.pids),
                "alive": [p for p in record.pids if alive(p)],
            }
        )
    )


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
