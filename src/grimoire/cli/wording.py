"""Error messages of the Python API reworded for the ``grimoire`` command: the fix is named as
the YAML key or section that makes it (``loss.ref_model: copy``, a ``peft:`` section,
``dataset.tokenize.response_field``) instead of the Python argument (``ref_model=...``,
``peft_config=LoraConfig(...)``, ``tokenize_sft(..., response_field=...)``).

The library's messages stay in Python terms for Python callers; the CLI rewrites them on the
way out (:func:`yaml_wording`). ``tests/test_newcomer_walls.py`` produces each message through the
real code path, so a reworded library message that no longer matches fails there.
"""

from __future__ import annotations

import re

#: The data section a row problem belongs to: ``... (dataset row 3)`` / ``(eval_dataset row 0)``.
_SECTION = re.compile(r"\((dataset|eval_dataset) row \d+\)")

_COLUMN_HINT = re.compile(r"\(pass \w+\(\.\.\., (\w+)=\.\.\.\) to use another column\)")
_MAP_HINT = re.compile(r"\(pass ((?:\w+_field=/?)+) to map columns\)")
_REFERENCE_HINT = (
    "pass ref_model=<a frozen copy of the starting model>, ref_model='copy' (copies the policy "
    "when training starts: twice the model's memory), or train with peft_config=LoraConfig(...) "
    "or a policy with a disable_adapter() context manager (the model with adapters disabled)"
)
_REFERENCE_YAML = (
    "set loss.ref_model: copy (a frozen copy of the starting model: twice its memory) or "
    "loss.ref_model: <a path or hub name>, or add a peft: section (LoRA: the base with adapters "
    "disabled is the reference)"
)
_CACHE_HINT = (
    "training.precompute_ref_log_probs=true (the starting policy, scored once before training) "
    "or grimoire.forward.precomputed.cache_reference_log_probs"
)
_CACHE_YAML = (
    "training.precompute_ref_log_probs: true (the starting model scores the data once before "
    "training), or loss.cache_reference: true"
)

_CACHE_PATTERN = re.compile(r"precompute columns \[[^\]]*\]: " + re.escape(_CACHE_HINT))


def _line(text: str) -> str:
    section = _SECTION.search(text)
    where = section.group(1) if section else "dataset"
    text = _COLUMN_HINT.sub(
        lambda m: f"(set {where}.tokenize.{m.group(1)}: <column> to use another column)", text
    )
    text = _MAP_HINT.sub(
        lambda m: (
            "(set "
            + " / ".join(
                f"{where}.tokenize.{k}" for k in m.group(1).rstrip("/").split("=/")
            ).rstrip("=")
            + " to map columns)"
        ),
        text,
    )
    text = text.replace(_REFERENCE_HINT, _REFERENCE_YAML)
    return _CACHE_PATTERN.sub(_CACHE_YAML, text)


def yaml_wording(message: str) -> str:
    """``message`` with every Python-worded fix replaced by its YAML key, line by line."""
    return "\n".join(_line(line) for line in message.split("\n"))


__all__ = ["yaml_wording"]
