"""A verifiers environment's dataset as the run's prompts (``loss.args.verifiers``).

When the loss names a verifiers environment, ``dataset`` may be left out (the environment's
train split is the dataset) or written ``{verifiers: train}`` / ``{verifiers: eval}`` with the
usual ``max_samples``, ``shuffle``, ``seed`` and ``tokenize``; ``eval_dataset:
{verifiers: eval}`` is its eval split (verifiers falls back to the train split when the
environment has none). The environment is loaded once, here, and handed to the loss as the
instance, so its dataset and its episodes are the same object's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grimoire.errors import DataError
from grimoire.rollout.agents.verifiers_env import load_verifiers_environment, verifiers_rows
from grimoire.rows.sources import LoadedSource, rows_to_dataset

#: A source section's key naming the environment's split.
KEY = "verifiers"
SPLITS = ("train", "eval")
#: The keys a ``{verifiers: ...}`` section may hold besides ``verifiers``.
OTHER_KEYS = {"max_samples": int, "shuffle": bool, "seed": int, "tokenize": Mapping}


def names_verifiers(raw: Mapping[str, Any]) -> bool:
    """True when ``loss.args`` names a verifiers environment."""
    loss = raw.get("loss")
    args = loss.get("args") if isinstance(loss, Mapping) else None
    return isinstance(args, Mapping) and args.get(KEY) is not None


def is_verifiers_section(section: Any) -> bool:
    return isinstance(section, Mapping) and KEY in section


def sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The run's dataset sections: ``dataset`` defaults to ``{verifiers: train}`` when the loss
    names a verifiers environment."""
    out = {where: raw[where] for where in ("dataset", "eval_dataset") if where in raw}
    if "dataset" not in out and names_verifiers(raw):
        out = {"dataset": {KEY: "train"}, **out}
    return out


def section_problems(raw: Mapping[str, Any], section: Mapping[str, Any], where: str) -> list[str]:
    """Every problem of a ``{verifiers: ...}`` section (no loading)."""
    problems = []
    if not names_verifiers(raw):
        problems.append(f"{where}.{KEY}: the loss names no verifiers environment (loss.args.{KEY})")
    if section[KEY] not in SPLITS:
        problems.append(f"{where}.{KEY}: one of {list(SPLITS)}, got {section[KEY]!r}")
    for key, value in section.items():
        if key == KEY:
            continue
        if key not in OTHER_KEYS:
            known = ", ".join([KEY, *OTHER_KEYS])
            problems.append(f"{where}.{key}: unknown key beside {KEY}:; valid keys: {known}")
        elif not isinstance(value, OTHER_KEYS[key]) or isinstance(value, bool) != (
            key == "shuffle"
        ):
            problems.append(f"{where}.{key}: must be {OTHER_KEYS[key].__name__}, got {value!r}")
    if section.get("max_samples") is not None and section["max_samples"] <= 0:
        problems.append(f"{where}.max_samples: must be > 0, got {section['max_samples']}")
    return problems


def environment(raw: Mapping[str, Any]) -> Any:
    """The environment ``loss.args.verifiers`` names, loaded (None when it names none); one
    :class:`~grimoire.errors.ConfigError` naming the key when it cannot be."""
    if not names_verifiers(raw):
        return None
    return load_verifiers_environment(raw["loss"]["args"][KEY], f"loss.args.{KEY}")


def read(env: Any, section: Mapping[str, Any], where: str) -> LoadedSource:
    """The rows of ``env``'s split (``verifiers_rows``), shuffled and cut as the section says."""
    ds = rows_to_dataset(verifiers_rows(env, section[KEY]), source=f"{where}.{KEY}")
    if len(ds) == 0:
        raise DataError([f"{where}: the verifiers environment's {section[KEY]} split has no rows"])
    if section.get("shuffle"):
        ds = ds.shuffle(seed=section.get("seed", 42))
    if section.get("max_samples") is not None:
        ds = ds.select(range(min(section["max_samples"], len(ds))))
    return LoadedSource(ds)


__all__ = [
    "KEY",
    "environment",
    "is_verifiers_section",
    "names_verifiers",
    "read",
    "section_problems",
    "sections",
]
