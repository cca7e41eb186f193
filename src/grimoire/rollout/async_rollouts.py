"""Asynchronous rollouts with a staleness bound (``loss.args.max_staleness = k >= 1``).

A producer THREAD samples and scores the rollouts of the next steps while the learner trains on
the current ones. It samples with its OWN copy of the policy (a deep copy made at bind), never
the learner's, through its own copy of the engine bound to that copy. Where the sampling runs:

- the HF engine's ``async_sampler``: ``"process"`` (default) a child process holding that copy
  in shared memory (:mod:`grimoire.rollout.engines.sampler_process`; the producer thread then only
  waits on a pipe and scores rewards), ``"thread"`` the producer thread itself (it shares the
  learner's GIL, which ``generate``'s Python loop holds for much of its time);
- ``vllm-server``: the server; the producer's engine pushes its copy's weights (the version
  that samples, never the learner's newer ones) before its requests. The learner's own engine
  (evaluation) shares the server; each engine pushes again when the other pushed last.

- versions: the weights after ``v`` optimizer steps are version ``v``. When the learner asks
  for step ``j``'s rollouts its weights are version ``j``; it publishes them then (a detached
  copy of its ``state_dict``, handed over under a lock, so the learner never waits on a
  sampling call). The producer loads the newest published state at the start of each step's
  generation.
- the bound: the producer generates step ``j``'s rollouts only with a version ``>= j - k``; it
  WAITS for the learner otherwise (nothing is ever discarded or regenerated: ``discarded``
  stays 0). So a group is trained at most ``k`` optimizer steps after the weights that sampled
  it, and the producer is never more than ``k + 1`` steps ahead. ``staleness/mean`` and
  ``staleness/max`` (learner version minus sampling version, over the step's groups) are logged.
- old log-probs: every rollout carries the SAMPLING weights' log-probs, so the policy-gradient
  ratio ``pi / pi_old`` (GRPO's clipped surrogate) is taken against the weights that sampled:
  the off-policy importance-sampling correction. The HF sampler records them while decoding
  (``decode_logps``: no scoring forward); vllm-server's are a forward of the sampler's copy
  (vLLM's own stay ``sampler_logps``, for the sampler/learner mismatch). Episodes are scored
  over the whole episode by the sampler's copy.
- order: the producer walks the planner's prompt micro-batches of the epoch in the planner's
  order (:meth:`AsyncRolloutStage.feed` wraps the trainer's iterator), one step at a time, so
  a run samples the same prompts in the same order as the synchronous loop.
- reference log-probs, advantages and the training batches are built on the learner's thread
  (:meth:`RolloutStage.step`): only the sampler's model is touched by the producer.

Checkpoints hold no rollouts: a resumed run regenerates from the checkpoint's weights (one log
line says the in-flight rollouts were discarded). The producer is stopped and joined when the
epoch's iterator ends or is closed (a stop, a signal, an error) and in :meth:`close`.

Several training processes (DDP): each rank has its own producer and HF sampler; the collectives
of a step (``build_batches``' statistics) run on the learner's thread. Limits (config errors
naming the key, :func:`async_problems`): the HF or vllm-server engine (vllm-server in one
training process), no FSDP2, episodes with the thread sampler or vllm-server; the producer does
not read ahead across an epoch boundary. With ``num_iterations = mu > 1`` it samples the first
step of each rollout batch only (the bound holds there; the stage trains the batch ``mu`` times).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from grimoire.collate.prompts import prompt_token_lists
from grimoire.config.context import TrainingContext
from grimoire.contract.layout import to_device
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.engines.sampler_process import SamplerProcess, autocast_factory
from grimoire.rollout.engines.vllm_server import VLLMServerEngine
from grimoire.rollout.rewards.background import BackgroundScoring
from grimoire.rollout.stage import RolloutStage, ScoredGroup

logger = logging.getLogger(__name__)

Micro = list[tuple[dict[str, Any], float]]


def checked_staleness(owner: str, max_staleness: Any) -> int:
    """``max_staleness`` if it is an int >= 0 (optimizer steps a rollout may lag the learner;
    0: synchronous rollouts), else a ValueError naming ``owner``."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"{owner}: max_staleness must be an int >= 0 (0: synchronous rollouts), got "
            f"{max_staleness!r}"
        )
    return max_staleness


def async_problems(
    key: str,
    max_staleness: int,
    engine: Any,
    sharded: bool = False,
    processes: int = 1,
    episodes: bool = False,
) -> list[str]:
    """What this run's settings lack for asynchronous rollouts (``key``: the setting's name)."""
    if max_staleness < 1:
        return []
    problems = []
    if not isinstance(engine, (HFGenerateEngine, VLLMServerEngine)):
        # The colocated engine shares the learner's process and devices (and sleeps while it
        # trains): its overlap is not built.
        problems.append(
            f"{key}={max_staleness} needs the hf or vllm-server engine (got "
            f"{type(engine).__name__}); set it to 0 for other engines"
        )
    if isinstance(engine, VLLMServerEngine) and processes > 1:
        # Its weight push ends in a barrier of all ranks: a collective the producer thread
        # would make beside the learner's own.
        problems.append(
            f"{key}={max_staleness} with engine vllm-server runs in one training process, got "
            f"{processes}; use the hf engine (one sampler per rank) or set it to 0"
        )
    if episodes and _sampler_process(engine):
        # An episode is many sampling calls and a scoring forward over the whole episode; the
        # sampler process serves single-turn requests only.
        problems.append(
            f"{key}={max_staleness} with episodes (tools/environment) needs "
            "engine.args.async_sampler: thread (the sampler process plays no episodes)"
        )
    if sharded:
        # The sampler's copy would be sharded too: its every forward a collective, run off the
        # learner's thread while the learner's own collectives run.
        problems.append(
            f"{key}={max_staleness} needs whole weights on each rank (DDP); the policy is "
            "sharded (distributed: fsdp2): set it to 0"
        )
    return problems


def _sampler_process(engine: Any) -> bool:
    """Whether ``engine`` samples asynchronously in a child process (the HF engine's
    ``async_sampler: process``; other engines sample in the producer thread)."""
    return getattr(engine, "async_sampler", "thread") == "process"


class AsyncRolloutStage(RolloutStage):
    """A :class:`RolloutStage` whose groups come from a producer thread (module docstring).

    Attributes for tests and benchmarks: ``timeline`` holds ``(who, step, start, end)``
    (``"sampler"``: one step's generation and scoring; ``"wait"``: the learner waiting for that
    step's rollouts), ``sampler_threads`` the torch thread count the sampler sets for itself
    (the process sampler: 1 when unset), ``sampler_cpu`` the core the process sampler is pinned
    to (None: not pinned), ``sampler_process`` the running child (process sampler).
    """

    def __init__(self, *args: Any, max_staleness: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_staleness = int(max_staleness)
        # Every async rollout carries the sampling weights' log-probs: the ratio's pi_old is
        # no longer the learner's own (which the sync stage may skip at one step per rollout).
        self.needs_old_logps = True
        self.sampler_threads: int | None = None
        self.sampler_model: torch.nn.Module | None = None
        self.sampler_engine: Any = None
        self.sampler_cpu: int | None = None
        self.sampler_process: SamplerProcess | None = None
        self._autocast: Any = None
        self.timeline: list[tuple[str, int, float, float]] = []
        self.discarded = 0
        self._policy: torch.nn.Module | None = None
        self._cond = threading.Condition()
        self._published: tuple[int, dict[str, torch.Tensor]] | None = None
        self._ready: dict[int, tuple[int, list[ScoredGroup], float]] = {}
        self._micro: dict[int, Micro] = {}
        self._finished = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fed = False
        #: The rollout batch being trained: (its first step, sampling version, sampling seconds).
        self._batch: tuple[int, int, float] | None = None

    def bind(self, ctx: TrainingContext) -> None:
        super().bind(ctx)
        self._policy = ctx.unwrapped_model
        self.sampler_model = copy.deepcopy(self._policy)
        self.sampler_model.requires_grad_(False)
        self.sampler_engine = copy.copy(self.engine)
        if isinstance(self.sampler_engine, HFGenerateEngine):
            self.sampler_engine.decode_logps = True  # old log-probs: the sampler's own
        engine = self.engine
        self._autocast = autocast_factory(ctx.config.mixed_precision, engine.device)
        self.sampler_engine.bind(
            self.sampler_model,
            self.pad_token_id,
            engine.eos_token_ids,
            engine.autocast,
            max_tokens=engine.max_tokens,
            max_length=engine.max_length,
        )

    # ------------------------------------------------------------------ the learner's side

    def publish(self, version: int) -> None:
        """Hand the learner's current weights (version ``version``) to the producer."""
        assert self._policy is not None, "bind() first"
        with self._cond:
            if self._published is not None and self._published[0] == version:
                return
        state = {k: v.detach().clone() for k, v in self._policy.state_dict().items()}
        with self._cond:
            self._published = (version, state)
            self._cond.notify_all()

    def feed(self, batches: Iterable[Any], first_step: int, in_epoch: int = 0) -> Iterator[Micro]:
        if first_step > 0 and not self._fed:
            logger.info(
                "async rollouts: resumed at step %d; rollouts in flight when the checkpoint was "
                "written were discarded (not saved), sampling restarts from its weights",
                first_step,
            )
        self._fed = True
        self._start(iter(batches), first_step, in_epoch)
        try:
            step = first_step
            while True:
                self.publish(step)  # the weights after `step` optimizer steps
                t0 = time.perf_counter()
                with self._cond:
                    while step not in self._micro and not self._finished and self._error is None:
                        self._cond.wait()
                    if self._error is not None:
                        raise RuntimeError("the rollout producer failed") from self._error
                    if step not in self._micro:
                        return
                    micro = self._micro.pop(step)
                    self.timeline.append(("wait", step, t0, time.perf_counter()))
                yield micro
                step += 1
        finally:
            self.shutdown()

    def scored_groups(self, ctx: TrainingContext, micro: Micro) -> tuple[list[ScoredGroup], int]:
        step = ctx.step.global_step
        with self._cond:
            version, groups, seconds = self._ready.pop(step)
        if step - version > self.max_staleness:  # the producer's wait makes this unreachable
            raise RuntimeError(f"rollouts of version {version} reached step {step}")
        self._batch = (step, version, seconds)
        return groups, 0

    def step(self, ctx: TrainingContext, micro: Micro) -> tuple[Micro, dict[str, float], float]:
        batches, metrics, weight = super().step(ctx, micro)
        assert self._batch is not None
        # One version per rollout batch; its reuse steps (num_iterations > 1) are later still.
        first, version, seconds = self._batch
        step = ctx.step.global_step
        waits = [end - start for who, s, start, end in self.timeline if who == "wait" and s == step]
        metrics.update(
            {
                "staleness/mean": float(step - version),
                "staleness/max": float(step - version),
                "time/sampler_generation": seconds if step == first else 0.0,
                "time/learner_wait": waits[-1] if waits else 0.0,
                # The sampler's copy of the engine pushes the weights (vllm-server), not ours.
                **self.sampler_engine.sync_metrics(),
            }
        )
        return batches, metrics, weight

    # ------------------------------------------------------------------ the producer

    def _start(self, batches: Iterator[Micro], first_step: int, in_epoch: int) -> None:
        self.shutdown()
        self._stop.clear()
        self._finished, self._error = False, None
        assert self.sampler_model is not None and self._policy is not None
        self.sampler_model.train(self._policy.training)  # old log-probs as the training forward
        if _sampler_process(self.engine):
            self.sampler_process = SamplerProcess(
                self.sampler_model,
                self.sampler_engine,
                self._autocast,
                threads=self.sampler_threads or 1,
                cpu=self.sampler_cpu,
            )
        self._thread = threading.Thread(
            target=self._produce,
            args=(batches, first_step, in_epoch),
            name="grimoire-rollouts",
            daemon=True,
        )
        self._thread.start()

    def _produce(self, batches: Iterator[Micro], first_step: int, in_epoch: int) -> None:
        """Sample the first step of every rollout batch (``in_epoch``: the first step's index in
        its epoch; a batch is ``steps_per_batch`` steps, the stage reuses it for the others,
        and a run resumed inside one samples at once, as the sync stage does)."""
        if self.sampler_threads is not None and self.sampler_process is None:
            torch.set_num_threads(self.sampler_threads)
        loaded = None
        try:
            for step, micro in enumerate(batches, start=first_step):
                reused = (in_epoch + step - first_step) % self.steps_per_batch and step > first_step
                if reused:  # the stage trains the batch sampled at its first step again
                    with self._cond:
                        self._micro[step] = micro
                        self._cond.notify_all()
                    continue
                with self._cond:
                    while not self._stop.is_set() and self._usable(step) is None:
                        self._cond.wait()
                    if self._stop.is_set():
                        return
                    version, state = self._usable(step)  # type: ignore[misc]
                if version != loaded:
                    self.sampler_model.load_state_dict(state)  # type: ignore[union-attr]
                    loaded = version
                t0 = time.perf_counter()
                groups = self._sample(micro)
                t1 = time.perf_counter()
                if groups is None:  # stopped while the process sampled
                    return
                with self._cond:
                    self._ready[step] = (version, groups, t1 - t0)
                    self._micro[step] = micro
                    self.timeline.append(("sampler", step, t0, t1))
                    self._cond.notify_all()
        except BaseException as error:  # handed to the learner, which raises it
            with self._cond:
                self._error = error
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _usable(self, step: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest published weights if they may sample ``step``'s rollouts."""
        published = self._published
        if published is None or published[0] < step - self.max_staleness:
            return None
        return published

    def _sample(self, micro: Micro) -> list[ScoredGroup] | None:
        """The step's groups, sampled by the sampler's copy (scored in the background while
        the next micro-batch samples when a reward function asks: ``overlap``)."""
        engine, g = self.sampler_engine, self.sampling.num_generations
        child = self.sampler_process
        with BackgroundScoring[ScoredGroup](self.overlap) as scoring:
            for host, keep in micro:
                if keep:
                    prompts = to_device(host, engine.device)
                    tokens = prompt_token_lists(prompts)
                    if self.agent is not None:  # episodes: the thread sampler (checked at set-up)
                        scoring.submit(self.play_later(prompts, engine=engine))
                        continue
                    if child is None:
                        rollout = engine.generate(tokens, g, with_old_logps=True)
                    else:
                        rollout = child.generate(tokens, g, stop=self._stop)
                        if rollout is None:
                            return None
                    scoring.submit(self.score_later(prompts, rollout))
            return scoring.results()

    def shutdown(self) -> None:
        """Stop the producer and join it (and end the sampler process); rollouts not yet
        trained on are dropped."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        thread.join()
        if self.sampler_process is not None:
            self.sampler_process.close()
            self.sampler_process = None
        with self._cond:
            self._ready.clear()
            self._micro.clear()
        self._thread = None

    def close(self) -> None:
        self.shutdown()
        super().close()


__all__ = ["AsyncRolloutStage", "async_problems", "checked_staleness"]
