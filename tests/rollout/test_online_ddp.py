"""GRPO under 2 CPU processes (gloo, ``accelerate launch``) vs 1 process.

The file is also the worker script: ``python test_online_ddp.py MODEL_DIR OUT_DIR BATCH``.
Each rank records which prompts it generated for; the test checks that ranks own disjoint
prompts, that every group (a prompt and its G completions) stays whole on its rank, and that both
runs finish and log the same metric keys (cross-rank metric reduction needs identical keys).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.train_utils import gloo_launch

ROOT = Path(__file__).resolve().parents[2]
G = 4


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def test_two_processes_own_whole_groups_and_log_the_same_keys(tiny_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(
        [sys.executable, __file__, str(tiny_dir), str(one), "4"],
        check=True,
        env=_env(),
        timeout=300,
    )
    subprocess.run(
        [*gloo_launch(2), __file__, str(tiny_dir), str(two), "2"],
        check=True,
        env=_env(),
        timeout=300,
    )

    def train_keys(folder: Path) -> list[set[str]]:
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        return [set(r) for r in lines if r["split"] == "train"]

    k1, k2 = train_keys(one), train_keys(two)
    assert len(k1) == len(k2) == 4
    assert json.loads((two / "world.json").read_text()) == 2  # really two processes
    assert k1 == k2
    assert {"rewards/mean", "clip_ratio/region_mean", "kl", "time/generation"} <= k2[0]

    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in range(2)]
    for step in range(4):
        seen = [set(), set()]
        for r, record in enumerate(ranks):
            for groups in record[step]:  # one entry per micro-batch: the prompt of each row
                assert len(groups) % G == 0
                for i in range(0, len(groups), G):
                    assert len(set(groups[i : i + G])) == 1  # a group is whole, on one rank
                seen[r].update(groups)
        assert seen[0] and seen[1] and not seen[0] & seen[1]  # disjoint prompts per rank


def _worker(model_dir: str, out_dir: str, batch: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire import GrimoireTrainer, TrainingConfig
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.model.tiny import reverse_rows
    from grimoire.rows.prompts import tokenize_grpo

    torch.set_num_threads(1)

    class Recording(GRPOMethod):
        """Records, per step and micro-batch, the prompt of every generated row."""

        def build_batches(self, ctx, groups):
            step = []
            for g in groups:
                step.append([p for p in g.prompts["prompt"] for _ in range(g.rollout.group_size)])
            self.log.append(step)
            return super().build_batches(ctx, groups)

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(32, seed=5)]
    config = TrainingConfig(
        output_dir=out_dir,
        max_steps=4,
        batch_size=batch,
        learning_rate=1e-2,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=1,
        lr_scheduler="constant",
        warmup_ratio=0.0,
    )
    method = Recording(
        ["char_match"],
        num_generations=G,
        max_new_tokens=6,
        beta=0.04,
        num_iterations=2,
        scale_rewards="batch",
        dynamic_sampling=True,
        ref_model="copy",
    )
    method.log: list[list[list[str]]] = []
    trainer = GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=rows,
    )
    trainer.train()
    # num_iterations=2: steps 2k and 2k+1 share one rollout; record it for both.
    per_step = [method.log[s // 2] for s in range(4)]
    rank = trainer.accelerator.process_index
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(per_step))
    Path(out_dir, "world.json").write_text(json.dumps(trainer.accelerator.num_processes))
    trainer.close()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
