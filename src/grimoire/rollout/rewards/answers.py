"""``answer_match``: the final answer of a completion against the dataset's, numerically.

Verifiable-reward recipes (GSM8K, MATH) pay 1.0 when the model's final answer equals the
reference. Two steps, each a small pure function:

1. **extract** the answer from the completion (:func:`extract_answer`): the last number
   (:func:`last_number`), the content of the last ``\\boxed{...}`` (:func:`boxed`), the text after
   GSM8K's ``#### `` marker (:func:`gsm8k_answer`), or ``auto``: boxed if there is one, else
   ``####`` if there is one, else the last number;
2. **compare** it with the reference (:func:`answers_match`): both read as exact rationals
   (:func:`parse_number`: ``"1,000" == "1000" == "1000.0"``, ``"-3" == "-3.00"``,
   ``"1/2" == "\\frac{1}{2}" == "0.5"``), else the texts with whitespace removed.

The reference is the dataset's column as it is, except that a GSM8K solution (with ``####``) or a
``\\boxed{}`` one is reduced to its answer first, so GSM8K's ``answer`` column is used unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

#: ``extract`` values of :class:`AnswerMatch`.
EXTRACTORS = ("auto", "last_number", "boxed", "gsm8k")

# A number as written in text: an optional sign (not after a word character or ')', so "5-3" is
# 5 and 3, not 5 and -3), thousands groups or plain digits, decimals, an optional "/denominator".
_NUMBER = re.compile(
    r"(?:(?<![\w)])[-+])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|(?:(?<![\w)])-)?\.\d+"
)
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_GSM8K = re.compile(r"####\s*([^\n]*)")


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``"so 1,000 or -3.00."`` -> ``"-3.00"``), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept whole), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return None  # unclosed: no answer rather than a guess


def gsm8k_answer(text: str) -> str | None:
    """What follows the last ``####`` on its line (GSM8K's answer marker), or None."""
    found = _GSM8K.findall(text)
    return found[-1].strip() if found else None


def extract_answer(text: str, extract: str = "auto") -> str | None:
    """The answer in a completion by one of :data:`EXTRACTORS` (see the module docstring)."""
    if extract == "last_number":
        return last_number(text)
    if extract == "boxed":
        return boxed(text)
    if extract == "gsm8k":
        return gsm8k_answer(text)
    if extract != "auto":
        raise ValueError(f"extract must be one of {EXTRACTORS}, got {extract!r}")
    for found in (boxed(text), gsm8k_answer(text)):
        if found is not None:
            return found
    return last_number(text)


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact rational, or None when it is not one number.

    Ignores ``$``, ``%``, spaces, thousands commas, a trailing period and LaTeX's ``\\frac{a}{b}``
    / ``\\dfrac``; exact (``Fraction``), so ``0.1 + 0.2``-style float error cannot flip a match.
    """
    s = _FRAC.sub(r"(\1)/(\2)", text.strip())
    s = re.sub(r"[\s$%]|\\[,!; ]|\\text\{[^{}]*\}", "", s).rstrip(".")
    s = s.replace("(", "").replace(")", "")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def reference_answer(answer: Any) -> str:
    """The answer in a dataset's reference: after ``####`` or in ``\\boxed{}`` when it has them
    (GSM8K / MATH solutions), else the whole value as text."""
    text = str(answer)
    for found in (gsm8k_answer(text), boxed(text)):
        if found is not None:
            return found
    return text.strip()


def answers_match(predicted: str, reference: str) -> bool:
    """Numerically equal when both are numbers, else equal texts with whitespace removed."""
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return re.sub(r"\s+", "", predicted) == re.sub(r"\s+", "", reference)


class AnswerMatch:
    """``answer_match``: 1.0 when the completion's extracted answer equals the reference, else
    0.0 (also when nothing can be extracted).

    Args:
        extract: ``auto`` (default), ``last_number``, ``boxed`` or ``gsm8k``
            (:func:`extract_answer`).
        answer_field: the dataset column holding the reference (default ``answer``).

    YAML ``{type: answer_match, args: {extract: boxed, answer_field: solution}}`` is
    ``AnswerMatch(extract="boxed", answer_field="solution")``.
    """

    __name__ = "answer_match"

    def __init__(self, extract: str = "auto", answer_field: str = "answer"):
        if extract not in EXTRACTORS:
            raise ValueError(f"extract must be one of {list(EXTRACTORS)}, got {extract!r}")
        if not isinstance(answer_field, str) or not answer_field:
            raise ValueError(f"answer_field must be a column name, got {answer_field!r}")
        self.extract, self.answer_field = extract, answer_field
        #: Read by the checks before training (the column is taken from ``**kwargs``).
        self.required_columns = (answer_field,)

    def __call__(self, completions: Sequence[str], **kwargs: Any) -> list[float]:
        if self.answer_field not in kwargs:
            raise KeyError(f"answer_match needs the dataset column {self.answer_field!r}")
        out = []
        for text, answer in zip(completions, kwargs[self.answer_field], strict=True):
            found = extract_answer(text, self.extract)
            ok = found is not None and answers_match(found, reference_answer(answer))
            out.append(float(ok))
        return out


__all__ = [
    "EXTRACTORS",
    "AnswerMatch",
    "answers_match",
    "boxed",
    "extract_answer",
    "gsm8k_answer",
    "last_number",
    "parse_number",
    "reference_answer",
]
