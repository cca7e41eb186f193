"""GRPO steps/s with synchronous vs asynchronous rollouts (``max_staleness``) on the CPU.

The toy reverse task from the bundled warm-started tiny Llama (``grimoire/assets/reverse_warm``,
as examples/grpo_toy.yaml). Threads are pinned per role: the main thread (the learner, and in
the sync rows also the sampler) runs ``torch.set_num_threads(T)``; the async sampler runs
``torch.set_num_threads(1)`` itself (``AsyncRolloutStage.sampler_threads``): ``(thread)`` in a
producer thread of the learner's process (sharing its GIL), ``(process)`` in a child process
pinned to the last allowed core (``AsyncRolloutStage.sampler_cpu``, ``os.sched_setaffinity``),
the learner's process (its main and producer threads) to the other cores. So async gets one
core for sampling and one for learning, and ``sync x1`` one core for both; ``--sync2`` adds
``sync x2`` (two threads for the one loop), the two-core baseline (on a shared, loaded machine
two threads per process oversubscribe the cores and that row is much slower, so it is not run
by default).

Per row: steps/s over steps 2..N (from the end of the first step, which cannot overlap and for
the process sampler includes starting the child, to the end of the last), sampler idle % (time
of that span the sampler is not generating or scoring), learner idle % (time of that span the
learner waits for rollouts; sync: the whole rollout), steps/s over the whole ``train()`` and the
first step's seconds, sampler and learner ms/step (the time each is busy per step: in the sync
rows the rollout and the rest of the step; in async rows they run at once, so each beside the
other: against the sync row they show what running side by side costs on this machine), the
mean training reward over the
last quarter of the steps (after ``N`` samples = steps x prompts x G), and steps/s as a ratio
to ``sync x1``.

    python benchmarks/async_rollouts.py                 # 32 steps per row, 14 new tokens
    python benchmarks/async_rollouts.py --tokens 8      # rollout a smaller share of a step
    python benchmarks/async_rollouts.py --steps 3       # seconds: table shape only
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import torch

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench

from grimoire import TrainingConfig
from grimoire.losses.grpo import GRPOMethod
from grimoire.rollout.async_rollouts import AsyncRolloutStage
from grimoire.training.callbacks import TrainerCallback


class Rewards(TrainerCallback):
    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.rollout: list[float] = []
        self.ends: list[float] = []

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        self.rewards.append(metrics["rewards/mean"])
        self.rollout.append(metrics.get("time/rollout", 0.0))
        self.ends.append(time.perf_counter())


def run(
    args: argparse.Namespace, staleness: int, threads: int, sampler: str = "process"
) -> dict[str, float]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    method = GRPOMethod(
        ["char_match", "exact_match"],
        reward_weights=[1.0, 0.5],
        num_generations=args.g,
        max_new_tokens=args.tokens,
        loss_type="dapo",
        max_staleness=staleness,
        engine={"type": "hf", "args": {"async_sampler": sampler}},
    )
    rewards = Rewards()
    with tempfile.TemporaryDirectory() as out:
        config = TrainingConfig(
            output_dir=out,
            max_steps=args.steps,
            batch_size=args.prompts,
            learning_rate=5e-4,
            lr_scheduler="constant",
            warmup_ratio=0.0,
            weight_decay=0.0,
            max_length=64,
            mixed_precision="no",
            gradient_checkpointing=False,
            disable_dropout=True,
            logging_steps=10**6,
            save_on_epoch_end=False,
            progress_bar=False,
            seed=0,
        )
        trainer = bench.reverse_warm_trainer(method, config, [rewards])
        stage = trainer.rollouts
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if isinstance(stage, AsyncRolloutStage):
            stage.sampler_threads = 1
            stage.sampler_cpu = cores[-1] if len(cores) > 1 else None  # the child's own core
        pinned = isinstance(stage, AsyncRolloutStage) and sampler == "process"
        pinned = pinned and stage.sampler_cpu is not None
        if pinned:  # the learner (and its producer thread) on the other cores
            os.sched_setaffinity(0, cores[:-1])
        start = time.perf_counter()
        try:
            trainer.train()
        finally:
            if pinned:
                os.sched_setaffinity(0, cores)
        wall = time.perf_counter() - start
        trainer.close()
    # Steady state: from the end of step 1 to the end of the last (the first step cannot
    # overlap, and the process sampler's start, importing torch in a fresh interpreter, is in it).
    lo, hi = rewards.ends[0], rewards.ends[-1]
    span = hi - lo

    def within(who: str) -> float:
        return sum(max(0.0, min(b, hi) - max(a, lo)) for w, _, a, b in stage.timeline if w == who)

    if isinstance(stage, AsyncRolloutStage):
        busy, waited = within("sampler"), within("wait")
    else:
        busy = waited = sum(rewards.rollout[1:])  # the learner waits through every rollout
    last = rewards.rewards[-max(1, args.steps // 4) :]
    per_step = span / (args.steps - 1)
    return {
        "first_s": lo - start,
        "steps_s": (args.steps - 1) / span,
        "sampler_ms": 1000 * busy / (args.steps - 1),
        "learner_ms": 1000 * (per_step - waited / (args.steps - 1)),
        "all_steps_s": args.steps / wall,
        "sampler_idle": 100 * max(0.0, 1 - busy / span),
        "learner_idle": 100 * waited / span,
        "reward": sum(last) / len(last),
    }


def concurrency_probe() -> float:
    """Time of one thread's matmuls while a second thread runs the same, over the time alone:
    1.00x when two cores are free for this process, 2.00x when the two threads share one (a
    machine loaded by other jobs); async can only gain what this leaves."""
    torch.set_num_threads(1)
    a = torch.randn(384, 384)

    def work() -> float:
        torch.set_num_threads(1)
        start = time.perf_counter()
        for _ in range(150):
            a @ a
        return time.perf_counter() - start

    alone = work()
    other = threading.Thread(target=work)
    other.start()
    together = work()
    other.join()
    return together / alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--g", type=int, default=16, help="num_generations")
    parser.add_argument("--tokens", type=int, default=14, help="max_new_tokens")
    parser.add_argument("--sync2", action="store_true", help="add the sync x2 row")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rows run in turn this many times; medians shown"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = [("sync x1", 0, 1, "process")] + [("sync x2", 0, 2, "process")] * args.sync2
    rows += [("async k=1 (thread)", 1, 1, "thread"), ("async k=1 (process)", 1, 1, "process")]
    probe = concurrency_probe()
    # Rows interleaved, round after round: a shared VM's speed drifts by tens of percent over a
    # minute, so one row after the other would compare different machines.
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in rows}
    for _ in range(args.rounds):
        for name, k, t, where in rows:
            runs[name].append(run(args, k, t, where))
    after = concurrency_probe()
    results = {name: _median_run(r) for name, r in runs.items()}
    samples = args.steps * args.prompts * args.g
    base = results["sync x1"]["steps_s"]
    print(
        f"GRPO, {args.steps} steps x {args.prompts} prompts x G={args.g}, "
        f"max_new_tokens={args.tokens} (reward: mean of the last quarter, after {samples} samples)"
    )
    print(
        f"concurrency probe (two threads' matmuls vs one alone; 1.00x = two free cores): "
        f"{probe:.2f}x before, {after:.2f}x after"
    )
    print(f"each row: the run of median steps/s of {args.rounds} (rows interleaved)")
    print("steps/s and idle %: steps 2..N (steady state); all steps/s and first step s: the")
    print("whole train(), the first step (which includes starting the sampler process) alone")
    print(
        "| run | steps/s | sampler idle % | learner idle % | sampler ms/step | learner ms/step "
        "| reward | vs sync x1 | all steps/s | first step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['steps_s']:.3f} | {r['sampler_idle']:.0f} | {r['learner_idle']:.0f} "
            f"| {r['sampler_ms']:.1f} | {r['learner_ms']:.1f} | {r['reward']:.3f} | {r['steps_s'] / base:.2f}x | {r['all_steps_s']:.3f} "
            f"| {r['first_s']:.2f} |"
        )
    for name in results:
        if name != "sync x1":
            ratios = [a["steps_s"] / b["steps_s"] for a, b in zip(runs[name], runs["sync x1"])]
            print(f"{name} / sync x1, round by round: " + ", ".join(f"{x:.2f}x" for x in ratios))


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run whose steps/s is the median (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["steps_s"])
    return ordered[(len(ordered) - 1) // 2]


if __name__ == "__main__":
    main()
