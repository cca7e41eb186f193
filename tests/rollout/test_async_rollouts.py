"""Asynchronous rollouts with a staleness bound (``max_staleness``): the producer thread samples
with its own copy of the weights, at most ``k`` optimizer steps old, in the planner's order.

The sync path (``max_staleness=0``) is the plain :class:`RolloutStage`; with ``k >= 1`` the
first step is sampled with the starting weights, so it equals the synchronous step (same
completions, rewards and loss); later steps are sampled by older weights, and their recorded
versions say by how much.
"""

from __future__ import annotations

import time

import pytest
import torch
from tests.helpers.train_utils import quiet_config

from grimoire import GrimoireTrainer
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import reverse_rows
from grimoire.rollout.async_rollouts import AsyncRolloutStage
from grimoire.rollout.rewards.scoring import char_match_reward
from grimoire.rollout.stage import RolloutStage
from grimoire.rows.prompts import tokenize_grpo
from grimoire.training.callbacks import TrainerCallback


class Steps(TrainerCallback):
    """Each step's logged metrics and the time it ended (``sleep``: learner made slower)."""

    def __init__(self, sleep: float = 0.0):
        self.metrics: list[dict[str, float]] = []
        self.ends: list[float] = []
        self.sleep = sleep

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        time.sleep(self.sleep)  # stands for a longer optimizer step
        self.metrics.append({"loss": loss, **metrics})
        self.ends.append(time.perf_counter())


def _trainer(
    tiny_dir,
    tmp_path,
    staleness,
    steps=4,
    reward=char_match_reward,
    sleep=0.0,
    engine=None,
    num_iterations=1,
    **overrides,
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(64, seed=3)]
    config = quiet_config(
        tmp_path,
        max_steps=steps,
        batch_size=overrides.pop("batch_size", 4),
        learning_rate=1e-2,
        disable_dropout=True,
        seed=0,
        **overrides,
    )
    method = GRPOMethod(
        [reward],
        num_generations=4,
        max_new_tokens=6,
        max_staleness=staleness,
        engine=engine,
        num_iterations=num_iterations,
    )
    steps_cb = Steps(sleep)
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=rows,
        callbacks=[steps_cb],
    )
    return trainer, steps_cb


def _run(tiny_dir, tmp_path, staleness, **kw):
    trainer, steps = _trainer(tiny_dir, tmp_path, staleness, **kw)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer, steps


def test_max_staleness_zero_is_the_synchronous_stage_and_reproduces_it(tiny_dir, tmp_path):
    a, sa = _run(tiny_dir, tmp_path / "a", 0)
    b, sb = _run(tiny_dir, tmp_path / "b", 0)
    assert type(a.rollouts) is RolloutStage  # no producer, no copy: today's code path
    for x, y in zip(sa.metrics, sb.metrics):
        assert x["rewards/mean"] == y["rewards/mean"] and x["loss"] == y["loss"]
    for p, q in zip(a.unwrapped_model.parameters(), b.unwrapped_model.parameters()):
        assert torch.equal(p, q)
    assert "staleness/max" not in sa.metrics[0]


def test_async_first_step_equals_sync_and_staleness_is_recorded(tiny_dir, tmp_path):
    _, sync = _run(tiny_dir, tmp_path / "sync", 0)
    # A slower learner (0.2 s more per step) keeps the producer ahead: staleness is exactly k.
    trainer, steps = _run(tiny_dir, tmp_path / "async", 1, sleep=0.2)
    assert isinstance(trainer.rollouts, AsyncRolloutStage)
    first, ref = steps.metrics[0], sync.metrics[0]
    # Step 0 is sampled by version 0 = the starting weights, from the same RNG state.
    assert first["rewards/mean"] == ref["rewards/mean"]
    assert first["completions/mean_length"] == ref["completions/mean_length"]
    # old log-probs come from the sampler's forward (not the fused training one): ratio ~1.
    assert first["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
    # k=1: the producer samples step 1 with version 0 at once, then step t+1 with version t.
    assert [m["staleness/max"] for m in steps.metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [m["staleness/mean"] for m in steps.metrics] == [0.0, 1.0, 1.0, 1.0]
    assert trainer.rollouts.discarded == 0


def test_async_samples_the_planners_prompts_in_order_and_is_reproducible(
    tiny_dir, tmp_path, monkeypatch
):
    seen: list[list[str]] = []
    score = RolloutStage.score

    def recording(self, prompts, rollout):
        seen.append(list(prompts["prompt"]))
        return score(self, prompts, rollout)

    monkeypatch.setattr(RolloutStage, "score", recording)
    _run(tiny_dir, tmp_path / "sync", 0, steps=5)
    sync_order, seen[:] = list(seen), []
    a, sa = _run(tiny_dir, tmp_path / "a", 1, steps=5)
    async_order, seen[:] = list(seen), []
    b, sb = _run(tiny_dir, tmp_path / "b", 1, steps=5)
    # The producer may sample past the last step before it is stopped: compare the trained ones.
    assert async_order[:5] == sync_order[:5] and seen[:5] == sync_order[:5]
    assert [m["rewards/mean"] for m in sa.metrics] == [m["rewards/mean"] for m in sb.metrics]
    assert [m["loss"] for m in sa.metrics] == [m["loss"] for m in sb.metrics]
    for p, q in zip(a.unwrapped_model.parameters(), b.unwrapped_model.parameters()):
        assert torch.equal(p, q)


class Snapshots(TrainerCallback):
    """The policy's weights after each step (version ``step``)."""

    def __init__(self, model):
        self.versions = {0: {k: v.clone() for k, v in model.state_dict().items()}}

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        time.sleep(0.2)  # keeps the producer ahead: every step after the first is 1 behind
        state = trainer.unwrapped_model.state_dict()
        self.versions[step] = {k: v.clone() for k, v in state.items()}


def test_async_old_logps_are_the_sampling_weights_not_the_learners(tiny_dir, tmp_path, monkeypatch):
    """The ratio's pi_old must be the policy that SAMPLED (version step - 1 at k=1): recompute
    each trained batch's log-probs under every version's weights, independently."""
    import copy

    from grimoire.forward.completions import batch_completion_logps

    batches: list[tuple[int, dict]] = []
    compute = GRPOMethod.compute_loss

    def recording(self, model, batch):
        batches.append((self._ctx.step.global_step, {k: v for k, v in batch.items()}))
        return compute(self, model, batch)

    monkeypatch.setattr(GRPOMethod, "compute_loss", recording)
    trainer, _ = _trainer(tiny_dir, tmp_path, 1, steps=4)
    snaps = Snapshots(trainer.unwrapped_model)
    trainer.callbacks.callbacks.append(snaps)
    try:
        trainer.train()
    finally:
        trainer.close()
    probe = copy.deepcopy(trainer.unwrapped_model)
    for step, batch in batches[1:]:  # step 0: sampled by the learner's own weights
        under = {}
        for version in (step - 1, step):
            probe.load_state_dict(snaps.versions[version])
            with torch.no_grad():
                under[version], _ = batch_completion_logps(probe, batch, 1.0, fused=False)
        sampler_err = (batch["old_logps"] - under[step - 1]).abs().max()
        learner_err = (batch["old_logps"] - under[step]).abs().max()
        assert sampler_err < 1e-6 and learner_err > 10 * sampler_err, (sampler_err, learner_err)


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_never_exceeds_max_staleness(tiny_dir, tmp_path, k):
    # A slower learner (0.3 s more per step) lets the producer run as far ahead as allowed, so
    # the bound is reached; it picks the newest weights, so a faster learner gives less.
    trainer, steps = _run(tiny_dir, tmp_path, k, steps=6, sleep=0.3)
    stale = [m["staleness/max"] for m in steps.metrics]
    assert len(stale) == 6 and stale[0] == 0 and all(s <= k for s in stale)
    assert max(stale) == k
    # The producer never runs more than k + 1 steps ahead of the learner's request.
    timeline = trainer.rollouts.timeline
    for who, step, start, _ in timeline:
        if who == "sampler" and step > k:
            waited = [s for w, s, st, _ in timeline if w == "wait" and st <= start]
            assert waited and max(waited) >= step - k


def slow_char_match(prompts, completions, answer, **kwargs):
    time.sleep(0.15)  # stands for a longer generation
    return char_match_reward(prompts, completions, answer)


def test_async_learner_does_not_wait_when_sampling_and_training_take_equal_time(tiny_dir, tmp_path):
    """Timestamps: sampling (slow reward, 0.15 s) and training (a 0.3 s step end) overlap: the
    producer starts step t+1's generation before the learner's step t ends, and has it ready
    before the learner asks for it (the learner's wait for it is empty of sampling)."""
    trainer, steps = _run(tiny_dir, tmp_path, 1, steps=5, reward=slow_char_match, sleep=0.3)
    sampler = {s: (a, b) for who, s, a, b in trainer.rollouts.timeline if who == "sampler"}
    waits = {s: (a, b) for who, s, a, b in trainer.rollouts.timeline if who == "wait"}
    for t in range(1, 4):
        assert sampler[t + 1][0] < steps.ends[t]  # generation of t+1 overlaps step t
        assert sampler[t + 1][1] <= waits[t + 1][0]  # ready before the learner asked
    # And without overlap (k=0) there is no producer at all.
    assert not hasattr(_trainer(tiny_dir, tmp_path / "s", 0)[0].rollouts, "timeline")


def test_async_producer_is_joined_on_error_and_on_close(tiny_dir, tmp_path):
    class Boom(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics) -> None:
            if step == 2:
                raise RuntimeError("boom")

    trainer, _ = _trainer(tiny_dir, tmp_path, 1, steps=5)
    trainer.callbacks.callbacks.append(Boom())
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    trainer.close()
    assert trainer.rollouts._thread is None
    assert not any(t.name == "grimoire-rollouts" and t.is_alive() for t in _threads())


def test_async_signal_stop_joins_producer_and_resume_discards_in_flight_rollouts(
    tiny_dir, tmp_path, caplog
):
    class Signal(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics) -> None:
            if step == 2:
                trainer._on_signal("SIGTERM")  # what the SIGTERM handler calls

    trainer, _ = _trainer(tiny_dir, tmp_path, 1, steps=5)
    trainer.callbacks.callbacks.append(Signal())
    trainer.train()
    assert trainer.preempted_by == "SIGTERM" and trainer.global_step == 2
    assert trainer.rollouts._thread is None  # joined when the loop stopped, before close()
    trainer.close()
    assert (tmp_path / "checkpoint-2").is_dir()
    with caplog.at_level("INFO", logger="grimoire.rollout.async_rollouts"):
        resumed, steps = _run(tiny_dir, tmp_path, 1, steps=5, resume_from_checkpoint="latest")
    lines = [r.getMessage() for r in caplog.records if "in flight" in r.getMessage()]
    assert len(lines) == 1 and "resumed at step 2" in lines[0]
    assert resumed.global_step == 5
    # Step 2 is sampled by the checkpoint's own weights; then one step behind, as before.
    assert [m["staleness/max"] for m in steps.metrics] == [0.0, 1.0, 1.0]


def _threads():
    import threading

    return threading.enumerate()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_max_staleness_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        GRPOMethod([char_match_reward], num_generations=2, max_staleness=bad)


def test_async_with_num_iterations_samples_each_batch_once_and_trains_it_mu_times(
    tiny_dir, tmp_path
):
    """num_iterations=2, k=1: the producer samples the first step of every rollout batch (steps
    0, 2, 4), with a version at most k old there; the batch's second step trains the same
    rollouts again, one step later still (staleness 0,1 | 1,2 | 1,2 with a slow learner). Its
    first two steps equal the synchronous run's (the same samples, trained twice)."""
    _, sync = _run(tiny_dir, tmp_path / "sync", 0, steps=2, num_iterations=2)
    trainer, steps = _run(tiny_dir, tmp_path / "async", 1, steps=6, sleep=0.2, num_iterations=2)
    assert [m["staleness/max"] for m in steps.metrics] == [0.0, 1.0, 1.0, 2.0, 1.0, 2.0]
    sampled = sorted({s for who, s, _, _ in trainer.rollouts.timeline if who == "sampler"})
    assert sampled[:3] == [0, 2, 4]
    reused = [m["time/sampler_generation"] for m in steps.metrics]
    assert all(reused[i] > 0 for i in (0, 2, 4)) and all(reused[i] == 0 for i in (1, 3, 5))
    for a, b in zip(steps.metrics[:2], sync.metrics, strict=True):
        assert a["rewards/mean"] == b["rewards/mean"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)


def test_async_with_num_iterations_resumed_inside_a_batch_samples_at_once(tiny_dir, tmp_path):
    """A checkpoint after step 3 (inside the batch of steps 2-3): the resumed run has no rollouts
    (none are saved), so it samples step 3 with the checkpoint's weights, as the sync stage
    does, then the batch of steps 4-5 one version behind."""

    class Signal(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics) -> None:
            if step == 3:
                trainer._on_signal("SIGTERM")

    trainer, _ = _trainer(tiny_dir, tmp_path, 1, steps=6, num_iterations=2)
    trainer.callbacks.callbacks.append(Signal())
    trainer.train()
    trainer.close()
    assert trainer.global_step == 3
    resumed, steps = _run(
        tiny_dir,
        tmp_path,
        1,
        steps=6,
        sleep=0.2,
        num_iterations=2,
        resume_from_checkpoint="latest",
    )
    assert resumed.global_step == 6
    assert [m["staleness/max"] for m in steps.metrics] == [0.0, 1.0, 2.0]
    sampled = sorted({s for who, s, _, _ in resumed.rollouts.timeline if who == "sampler"})
    assert sampled[:2] == [3, 4]
