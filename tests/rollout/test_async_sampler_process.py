"""The asynchronous HF sampler in its own process (``engine.args.async_sampler``): failures in
the child surface in the learner naming it, the child never outlives training, and the thread
sampler stays selectable and trains the same run.

The guarantees of asynchronous rollouts (k=0 is the sync path, reproducibility, the staleness
bound, old log-probs of the sampling weights, the learner-does-not-wait timestamps) are proved in
``test_async_rollouts.py``, whose runs use the process sampler (the default).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from tests.rollout.test_async_rollouts import _run, _trainer

from grimoire.errors import ConfigError
from grimoire.rollout.engines.backends import build_engine, engine_problems
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.engines.sampler import SamplerConfig
from grimoire.rollout.engines.sampler_process import SamplerProcess
from grimoire.training.callbacks import TrainerCallback


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the process table: only acceptable as a zombie nobody waits for (not ours).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def _child(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    engine = HFGenerateEngine(max_new_tokens=3)
    engine.bind(model, tok.pad_token_id, tok.eos_token_id)
    return SamplerProcess(model, engine), model.config.vocab_size


def test_async_process_sampler_error_in_the_child_is_raised_naming_it(tiny_dir):
    child, vocab = _child(tiny_dir)
    try:
        rollout = child.generate([[5, 6, 7]], 2)
        assert rollout is not None and rollout.completion_ids.shape[0] == 2
        assert rollout.old_logps is not None  # scored in the child
        with pytest.raises(RuntimeError, match=rf"sampler process \(pid {child.pid}\) failed"):
            child.generate([[vocab + 100, 5]], 2)  # an embedding index out of range
    finally:
        child.close()
    assert not child.process.is_alive() and _gone(child.pid)


def test_async_process_sampler_that_dies_is_detected_not_waited_for(tiny_dir):
    child, _ = _child(tiny_dir)
    try:
        os.kill(child.pid, signal.SIGKILL)
        child.process.join(10)
        with pytest.raises(RuntimeError, match=rf"pid {child.pid}\) died with exit code -9"):
            child.generate([[5, 6]], 2)
    finally:
        child.close()


class Pids(TrainerCallback):
    def __init__(self):
        self.pids: set[int] = set()

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        process = trainer.rollouts.sampler_process
        if process is not None:
            self.pids.add(process.pid)


@pytest.mark.parametrize("stop", ["error", "signal", "finish"])
def test_async_process_sampler_is_ended_on_error_signal_stop_and_finish(tiny_dir, tmp_path, stop):
    class Stop(TrainerCallback):
        def on_step_end(self, trainer, step, loss, metrics) -> None:
            if step == 2 and stop == "error":
                raise RuntimeError("boom")
            if step == 2 and stop == "signal":
                trainer._on_signal("SIGTERM")

    trainer, _ = _trainer(tiny_dir, tmp_path, 1, steps=4)
    pids = Pids()
    trainer.callbacks.callbacks += [pids, Stop()]
    if stop == "error":
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()
    else:
        trainer.train()
    # Ended when the loop stopped, before close(): no orphan, nothing left to the caller.
    assert trainer.rollouts.sampler_process is None
    assert len(pids.pids) == 1 and all(_gone(pid) for pid in pids.pids)
    trainer.close()


def test_async_sampler_setting_takes_process_or_thread_only():
    bad = {"type": "hf", "args": {"async_sampler": "fork"}}
    assert engine_problems(bad) == [
        "engine.args.async_sampler: 'fork'; expected 'process' or 'thread'"
    ]
    with pytest.raises(ConfigError, match="async_sampler"):
        build_engine(bad, SamplerConfig())
    with pytest.raises(ValueError, match="async_sampler"):
        HFGenerateEngine(async_sampler="fork")
    assert HFGenerateEngine().async_sampler == "process"


def test_async_thread_and_process_samplers_train_the_same_run(tiny_dir, tmp_path):
    """Same prompts, same RNG stream (the child starts from the parent's RNG state), same
    versions (a slower learner keeps both one step behind): the same rewards, losses, weights."""
    runs = {}
    for where in ("process", "thread"):
        engine = {"type": "hf", "args": {"async_sampler": where}}
        trainer, steps = _run(tiny_dir, tmp_path / where, 1, sleep=0.2, engine=engine)
        assert (trainer.rollouts.sampler_process is None) and steps.metrics
        runs[where] = (trainer, steps)
    (a, sa), (b, sb) = runs["process"], runs["thread"]
    assert [m["staleness/max"] for m in sa.metrics] == [m["staleness/max"] for m in sb.metrics]
    assert [m["rewards/mean"] for m in sa.metrics] == [m["rewards/mean"] for m in sb.metrics]
    for x, y in zip(sa.metrics, sb.metrics):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7)
    for p, q in zip(a.unwrapped_model.parameters(), b.unwrapped_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
