"""GRPO step time with a slow LLM-judge reward, its scoring overlapped with sampling or not.

The toy reverse task from the bundled warm-started tiny Llama (``grimoire/assets/reverse_warm``)
with one reward, ``llm_judge``, asking the loopback stand-in judge of the tests
(``tests/helpers/judge_server.py``, in a process of its own), which answers each request after ``--delay`` seconds (a
judge model's generation on another server). A step is ``--micro`` prompt micro-batches
(``gradient_accumulation_steps``) of ``--prompts`` prompts x ``G``; the judge takes all of a
micro-batch's requests at once (``max_concurrency = prompts x G``), so scoring a micro-batch
costs about one ``--delay``.

Two rows, the judge's ``overlap: false`` (score each micro-batch after sampling it, as every
reward function is scored) and ``overlap: true`` (score it in the background while the next
micro-batch samples), run in turn ``--rounds`` times (a shared machine's speed drifts); each
row shows the median over rounds of the mean step time over steps 2..N, the rollout part of
it (``time/rollout``: sampling and scoring), and the ratio of the two rows, round by round.
Both rows train on the same rewards: the script checks that each step's mean reward and loss
are equal in the two.

Expected: without overlap a step's rollout is ``sum_k (sample_k + delay)``; with it about
``sum_k max(sample_k, delay) + min(sample_k, delay)`` for the last (nothing to overlap with):
the script prints that bound, taking the sampling time from the row without overlap.

    python benchmarks/judge_overlap.py                     # 6 steps, delay 0.3 s, 4 micro-batches
    python benchmarks/judge_overlap.py --steps 3 --rounds 1   # seconds: the table's shape only
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench

sys.path.insert(0, str(bench.ROOT))  # the stand-in judge lives with the tests
from tests.helpers.judge_server import mode_url

from grimoire.losses.grpo import GRPOMethod
from grimoire.training.callbacks import TrainerCallback

PROMPT = "Task: {prompt}\nAnswer: {completion}\nRate the answer from 0 to 10."


class Steps(TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []
        self.metrics: list[dict[str, float]] = []

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        self.ends.append(time.perf_counter())
        self.metrics.append({"loss": loss, **metrics})


def run(args: argparse.Namespace, judge_root: str, overlap: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    judge = {
        "base_url": mode_url(judge_root, f"delay/{args.delay}"),
        "model": "stand-in",
        "prompt": PROMPT,
        "max_concurrency": args.prompts * args.g,
        "overlap": overlap,
    }
    method = GRPOMethod(
        [{"type": "llm_judge", "args": judge}],
        num_generations=args.g,
        max_new_tokens=args.tokens,
    )
    steps = Steps()
    with tempfile.TemporaryDirectory() as out:
        config = bench.training_config(
            out,
            max_steps=args.steps,
            batch_size=args.prompts,
            gradient_accumulation_steps=args.micro,
            learning_rate=5e-4,
            max_length=64,
            gradient_checkpointing=False,
            logging_steps=10**6,
            seed=0,
        )
        trainer = bench.reverse_warm_trainer(method, config, [steps])
        assert trainer.rollouts.overlap is overlap
        try:
            trainer.train()
        finally:
            trainer.close()
    # Steps 2..N: the first also loads and warms up.
    span = steps.ends[-1] - steps.ends[0]
    rollout = [m["time/rollout"] for m in steps.metrics[1:]]
    return {
        "step_s": span / (args.steps - 1),
        "rollout_s": sum(rollout) / len(rollout),
        "rewards": [(m["rewards/mean"], m["loss"]) for m in steps.metrics],
        "failures": sum(m["rewards/llm_judge/failures"] for m in steps.metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=4, help="prompt micro-batches per step")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per micro-batch")
    parser.add_argument("--g", type=int, default=16, help="num_generations")
    parser.add_argument("--tokens", type=int, default=14, help="max_new_tokens")
    parser.add_argument("--delay", type=float, default=0.3, help="the judge's seconds per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    # The judge runs in its own process, as a real one does (not sharing the trainer's GIL).
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.judge_server"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=bench.ROOT,
        env=bench.child_env(),
    )
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    try:
        assert server.stdout is not None
        root = server.stdout.readline().strip()
        for _ in range(args.rounds):  # rows interleaved: a shared machine's speed drifts
            for overlap in (False, True):
                runs[overlap].append(run(args, root, overlap))
    finally:
        server.terminate()
        server.wait(timeout=30)
    for a, b in zip(runs[False], runs[True]):
        assert a["rewards"] == b["rewards"], "overlap changed a reward or a loss"
        assert a["failures"] == b["failures"] == 0, "the stand-in judge failed"
    print(bench.machine_line(f", torch threads {args.threads}"))
    print(
        f"GRPO on the tiny reverse task: {args.steps} steps x {args.micro} micro-batches x "
        f"{args.prompts} prompts x G={args.g}, max_new_tokens={args.tokens}; llm_judge answering "
        f"after {args.delay} s per request, {args.prompts * args.g} at once; medians of "
        f"{args.rounds} rounds, steps 2..N; rewards and losses equal in both rows: checked"
    )
    print("| judge overlap | s/step | rollout s/step (sampling + scoring) |")
    print("|---|---|---|")
    for overlap, rs in runs.items():
        step = statistics.median(r["step_s"] for r in rs)
        roll = statistics.median(r["rollout_s"] for r in rs)
        print(f"| {str(overlap).lower()} | {step:.3f} | {roll:.3f} |")
    # The bound: the judge's time per step is micro x delay (all of a micro-batch's requests at
    # once); what the row without overlap took besides it is sampling, of which all but the
    # first micro-batch's can hide behind a judge call at most.
    plain = statistics.median(r["rollout_s"] for r in runs[False])
    sample = max(0.0, plain - args.micro * args.delay) / args.micro
    ideal = plain - (args.micro - 1) * min(sample, args.delay)
    print(
        f"rollout s/step without overlap: {args.micro} x {args.delay} s of judge + "
        f"{plain - args.micro * args.delay:.3f} s of sampling; with a perfect overlap: {ideal:.3f}"
    )
    ratios = [a["step_s"] / b["step_s"] for a, b in zip(runs[False], runs[True])]
    print(
        "step time without / with overlap, round by round: "
        + ", ".join(f"{x:.2f}x" for x in ratios)
    )


if __name__ == "__main__":
    main()
