"""The asynchronous HF sampler in its own process (``engine.args.async_sampler: process``).

Why a process: the HF engine's ``generate`` is a Python loop (one decoding step per iteration),
so a sampler THREAD holds the GIL for much of its time and slows the learner it should overlap
with. A child process has its own interpreter: the parent's producer thread only waits on a pipe
(GIL released) and scores the rewards.

What runs where:

- the child (``spawn`` context: never ``fork`` once the learner's threads exist) holds the
  sampler's copy of the policy, whose tensors live in SHARED memory (``Module.share_memory``,
  handed over once at start), runs ``generate`` (recording the old log-probs) with
  ``threads`` torch threads (1 by default) and, if ``cpu`` is given, pinned to that core.
- weights: the parent's producer copies the published version into the shared tensors
  (``load_state_dict``: an in-place copy, no pickling) between two requests, when the child is
  idle; so a request is always sampled by exactly one version.
- requests: prompt token lists in, the :class:`~grimoire.rollout.engines.base.Rollout` out (its
  tensors pass through shared memory). The child starts from the parent's torch RNG state at
  start, so a run is reproducible and its first step samples what the synchronous step would.
- failures: an exception in the child comes back with its traceback and is raised in the parent
  as a RuntimeError naming the child's pid; a child that dies is detected while waiting. The
  child exits when asked (:meth:`SamplerProcess.close`: join, then terminate, then kill) and by
  itself when its parent is gone (it polls its parent's pid), so no process is orphaned.
"""

from __future__ import annotations

import copy
import os
import queue
import traceback
from contextlib import nullcontext, suppress
from functools import partial
from typing import Any

import torch
import torch.multiprocessing as mp

from grimoire.rollout.engines.base import Rollout, RolloutEngine

#: Where the asynchronous HF sampler runs (``engine.args.async_sampler``).
ASYNC_SAMPLERS = ("process", "thread")


def _attention_functions(model: torch.nn.Module) -> list[tuple[str, str, Any]]:
    """The model's attention (and mask) functions registered at runtime in this process (e.g.
    grimoire's packed attention), as ``(interface, name, function)`` for the child to register:
    a spawned child starts with transformers' built-in ones only."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    found = []
    for label, interface in (("attention", AttentionInterface), ("mask", AttentionMaskInterface)):
        if isinstance(name, str) and name in interface._global_mapping:
            found.append((label, name, interface._global_mapping[name]))
    return found


def _register(functions: list[tuple[str, str, Any]]) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for label, name, function in functions:
        interface = AttentionInterface if label == "attention" else AttentionMaskInterface
        if name not in interface._global_mapping:
            interface.register(name, function)


def _serve(
    functions: list[tuple[str, str, Any]],
    model: torch.nn.Module,
    engine: RolloutEngine,
    bind: dict[str, Any],
    threads: int,
    cpu: int | None,
    parent: int,
    requests: Any,
    replies: Any,
) -> None:
    """The child's loop: ``("rng", state)`` sets the RNG, ``("generate", (prompts, n))``
    samples; ``None`` ends it."""
    torch.set_num_threads(threads)
    _register(functions)
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    engine.bind(model, **bind)
    while True:
        try:
            message = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the parent died without closing us
                return
            continue
        if message is None:
            return
        kind, payload = message
        try:
            if kind == "rng":
                torch.set_rng_state(payload)
                continue
            prompts, n = payload
            rollout = engine.generate(prompts, n, with_old_logps=True)
            replies.put(("ok", rollout))
        except BaseException:  # sent to the parent, which raises it
            replies.put(("error", traceback.format_exc()))


def autocast_factory(mixed_precision: str | None, device: torch.device) -> Any:
    """A picklable autocast factory for the child (the accelerator's own is a bound method)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no")
    if dtype is None:
        return nullcontext
    return partial(torch.autocast, device_type=device.type, dtype=dtype)


class SamplerProcess:
    """A child process sampling with ``model`` (module docstring).

    ``model``: the sampler's copy of the policy (its tensors are moved to shared memory here);
    ``engine``: the bound HF engine whose settings the child uses (copied unbound);
    ``autocast``: a picklable autocast factory (:func:`autocast_factory`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        engine: RolloutEngine,
        autocast: Any = nullcontext,
        threads: int = 1,
        cpu: int | None = None,
    ):
        model.share_memory()
        unbound = copy.copy(engine)
        unbound.model, unbound.agree, unbound.autocast = None, None, nullcontext
        bind = dict(
            pad_token_id=engine.pad_token_id,
            eos_token_id=list(engine.eos_token_ids),
            autocast=autocast,
            max_tokens=engine.max_tokens,
            max_length=engine.max_length,
        )
        context = mp.get_context("spawn")
        self.requests = context.Queue()
        self.replies = context.Queue()
        self.process = context.Process(
            target=_serve,
            args=(
                _attention_functions(model),
                model,
                unbound,
                bind,
                threads,
                cpu,
                os.getpid(),
                self.requests,
                self.replies,
            ),
            name="grimoire-sampler",
            daemon=True,
        )
        self.process.start()
        self.requests.put(("rng", torch.get_rng_state()))

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def generate(self, prompts: list[list[int]], n: int, stop: Any = None) -> Rollout | None:
        """The child's rollout of ``prompts`` (``n`` each); None if ``stop`` (an Event) is set
        while waiting."""
        self.requests.put(("generate", (prompts, n)))
        while True:
            try:
                kind, payload = self.replies.get(timeout=0.2)
                break
            except queue.Empty:
                if stop is not None and stop.is_set():
                    return None
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the sampler process (pid {self.pid}) died with exit code "
                        f"{self.process.exitcode} while sampling"
                    ) from None
        if kind == "error":
            raise RuntimeError(f"the sampler process (pid {self.pid}) failed:\n{payload}")
        return payload

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to exit, then terminate (and kill) it if it does not; idempotent."""
        if self.process.exitcode is None and self.process.is_alive():
            with suppress(ValueError, OSError):  # the queue is closed already
                self.requests.put(None)
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        for q in (self.requests, self.replies):
            q.close()
            q.cancel_join_thread()


__all__ = ["ASYNC_SAMPLERS", "SamplerProcess", "autocast_factory"]
