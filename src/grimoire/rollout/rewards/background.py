"""Slow rewards scored while the next micro-batch samples.

A step's prompt micro-batches are sampled one after another (``gradient_accumulation_steps``
of them per step, on each rank). When a reward function is slow (an LLM judge waits on another
server) and declares ``overlap_sampling``, the stage hands each micro-batch's scoring to
:class:`BackgroundScoring` and samples the next at once; the scores are read when the step's
groups are all needed (the advantages and the step's statistics are built from them)::

    sample 0 | sample 1 | sample 2 |            (calling thread)
             | score 0  | score 1  | score 2    (one background thread)

The step then takes ``max(sampling, scoring)`` per micro-batch instead of their sum, plus the
last micro-batch's scoring. With one micro-batch per step there is nothing to overlap (the
asynchronous producer, ``max_staleness >= 1``, overlaps a whole step's rollouts with training,
and this inside it).

Why nothing changes but the time: every scoring is the same call on the same inputs as without
overlap (the caller decodes first, on its own thread: a tokenizer is not shared across threads),
one at a time in submission order (one worker), and the results come back in that order, so the
rewards, advantages and losses are the same bit for bit. A scoring that raises is raised in the
caller (at the next :meth:`BackgroundScoring.submit` or at :meth:`BackgroundScoring.results`),
the scorings not yet started are cancelled. Sampling does not wait for a scoring, so a reward
function that overlaps runs beside the sampler: it must be thread-safe against it (an HTTP call
is; one that samples from the policy is not).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BackgroundScoring(Generic[T]):
    """Scorings (calls without arguments) run in submission order, in one background thread when
    ``overlap`` is True, else at once in the calling thread (see the module docstring). A
    context manager: leaving it cancels what has not started and waits for what has."""

    def __init__(self, overlap: bool):
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="grimoire-rewards") if overlap else None
        )
        self._futures: list[Future[T]] = []

    def __enter__(self) -> BackgroundScoring[T]:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, score: Callable[[], T]) -> None:
        """Queue ``score`` (run it now without overlap), after raising an earlier one's error."""
        self._raise_failed()
        if self._pool is not None:
            self._futures.append(self._pool.submit(score))
            return
        done: Future[T] = Future()
        done.set_result(score())
        self._futures.append(done)

    def results(self) -> list[T]:
        """Every scoring's result, in submission order (waits for those still running)."""
        return [f.result() for f in self._futures]

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                f.result()


__all__ = ["BackgroundScoring"]
