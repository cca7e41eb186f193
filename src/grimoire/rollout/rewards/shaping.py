"""Shaping rewards: ``think_format`` (a reasoning block, then the answer) and ``overlong_penalty``
(DAPO's soft length penalty). Both are classes whose constructor takes the options, so the YAML
entry ``{type: think_format, args: {...}}`` is ``ThinkFormat(...)`` in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _once(text: str, tag: str) -> bool:
    return text.count(tag) == 1


def strict_format(text: str, think: tuple[str, str], answer: tuple[str, str] | None = None) -> bool:
    """Whether ``text`` (stripped) is ``think[0] reasoning think[1] answer`` and nothing else.

    Each non-empty tag occurs exactly once, the reasoning and the answer are not blank; an empty
    ``think[0]`` means the block opens before the completion (a chat template that ends its
    generation prompt with ``<think>``). With ``answer`` tags, the part after the reasoning is
    ``answer[0] answer answer[1]`` exactly.
    """
    text = text.strip()
    tags = [t for t in (*think, *(answer or ())) if t]
    if not all(_once(text, t) for t in tags) or not text.startswith(think[0]):
        return False
    reasoning, _, rest = text[len(think[0]) :].partition(think[1])
    rest = rest.strip()
    if not reasoning.strip() or not rest:
        return False
    if answer is None:
        return True
    if not (rest.startswith(answer[0]) and rest.endswith(answer[1])):
        return False
    return bool(rest[len(answer[0]) : len(rest) - len(answer[1])].strip())


class ThinkFormat:
    """``think_format``: 1.0 when the completion is a reasoning block then an answer, else 0.0.

    The format (:func:`strict_format`): ``<think>`` reasoning ``</think>`` answer, each tag once,
    neither part blank, nothing before the block; with ``answer_start``/``answer_end`` set, the
    answer must be wrapped in them with nothing after.

    ``partial=True`` gives credit on the way there:
    ``0.5 * (tags occurring exactly once) / (tags) + 0.5 * [the full format holds]``, so 1.0 is
    still only the full format, and a completion with every tag once but out of order gets 0.5.

    Args:
        think_start, think_end: the reasoning block's tags (default ``<think>``, ``</think>``;
            ``think_start: ""`` when the chat template's generation prompt already opened it).
        answer_start, answer_end: optional answer tags (e.g. ``<answer>``, ``</answer>``); both
            or neither.
        partial: partial credit as above (default off: 1.0/0.0).
    """

    __name__ = "think_format"

    def __init__(
        self,
        think_start: str = "<think>",
        think_end: str = "</think>",
        answer_start: str = "",
        answer_end: str = "",
        partial: bool = False,
    ):
        if not think_end:
            raise ValueError("think_end must be a non-empty tag (it ends the reasoning)")
        if bool(answer_start) != bool(answer_end):
            raise ValueError("answer_start and answer_end: give both tags or neither")
        self.think = (think_start, think_end)
        self.answer = (answer_start, answer_end) if answer_start else None
        self.partial = bool(partial)

    def score(self, text: str) -> float:
        """One completion's reward (see the class docstring)."""
        full = float(strict_format(text, self.think, self.answer))
        if not self.partial:
            return full
        tags = [t for t in (*self.think, *(self.answer or ())) if t]
        present = sum(_once(text, t) for t in tags) / len(tags)
        return 0.5 * present + 0.5 * full

    def __call__(self, completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [self.score(text) for text in completions]


def soft_overlong_penalty(length: int, max_completion_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment of a ``length``-token completion (Yu et al., 2025,
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476, section 3.4):
    0 up to ``max - cache`` tokens, then linear down to -1 at ``max``, and -1 beyond."""
    free = max_completion_length - cache_length
    if length <= free:
        return 0.0
    if length <= max_completion_length:
        return (free - length) / cache_length
    return -1.0


class OverlongPenalty:
    """``overlong_penalty``: DAPO's soft overlong punishment, in tokens of ``completion_ids``
    (:func:`soft_overlong_penalty`; Yu et al., 2025, arXiv:2503.14476).

    ``r = 0`` for ``L <= max - cache``; ``r = (max - cache - L) / cache`` for
    ``max - cache < L <= max``; ``r = -1`` for ``L > max``, where ``L`` is the number of sampled
    tokens (EOS included when the completion stopped on it). Added to a correctness reward it
    discourages running into the length limit without the cliff of a hard truncation penalty.

    Args:
        max_completion_length: ``max`` (usually the method's ``max_new_tokens``).
        cache_length: ``cache``, the width of the linear ramp, ``1 <= cache <= max``.
    """

    __name__ = "overlong_penalty"

    def __init__(self, max_completion_length: int, cache_length: int):
        for key, value in (
            ("max_completion_length", max_completion_length),
            ("cache_length", cache_length),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        if cache_length > max_completion_length:
            raise ValueError(
                f"cache_length ({cache_length}) must be <= max_completion_length "
                f"({max_completion_length})"
            )
        self.max_completion_length, self.cache_length = max_completion_length, cache_length

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        return [
            soft_overlong_penalty(len(ids), self.max_completion_length, self.cache_length)
            for ids in completion_ids
        ]


__all__ = ["OverlongPenalty", "ThinkFormat", "soft_overlong_penalty", "strict_format"]
