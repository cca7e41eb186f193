"""The YAML/CLI schema of ``grimoire train``: loading, overrides, validation.

Nothing here loads a model or a dataset: :func:`validate_config` only reads the config (and
imports the loss/tokenizer/callback classes it names, to check their arguments), so every
problem in every section is reported in one :class:`ConfigError` before anything expensive runs.
See ``docs/cli.md`` for the schema; the mini_trainer flags applied by :func:`load_config` come
from :mod:`grimoire.compat.mini_trainer` (re-exported here).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grimoire.cli import verifiers_source
from grimoire.cli.model import REF_MODEL_COPY, TINY_PREFIX, canonical_model, model_problems
from grimoire.cli.paths import reference_problems
from grimoire.cli.sections import section_problems, unknown_keys
from grimoire.compat.mini_trainer import MINI_TRAINER_BASE, apply_mini_trainer_flags
from grimoire.compat.trl_names import TRL_NAMES, trl_hint
from grimoire.config import registry
from grimoire.config.loading import (
    ConfigLoader,
    apply_overrides,
    parse_override,
    parse_yaml,
    read_yaml_file,
)
from grimoire.config.training import TrainingConfig, check_type
from grimoire.errors import ConfigError
from grimoire.rollout.engines.backends import engine_problems
from grimoire.rollout.rewards.scoring import resolve_reward_funcs
from grimoire.rows.sources import source_problems
from grimoire.training.callbacks import hook_problems

#: The embedded default run (``python -m grimoire.cli.main`` with no ``--config``).
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "assets" / "quickstart.yaml"

TOP_KEYS = (
    "model",
    "quantization",
    "dataset",
    "eval_dataset",
    "loss",
    "peft",
    "training",
    "callbacks",
    "save_to",
    "wandb",
)
WANDB_KEYS: dict[str, Any] = {"project": str | None, "entity": str | None}
#: ``peft.type`` values (grimoire-rl's key); the rest of the section is ``LoraConfig``'s fields.
PEFT_TYPES = ("lora",)
#: Arguments the CLI supplies itself to every tokenize function.
TOKENIZE_RESERVED = ("tokenizer",)


# --------------------------------------------------------------------------- loading
# The YAML loader and --set live in grimoire.config.loading (the tools read configs too).


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The raw config: the YAML file (or the embedded default), then flags, then ``--set``.

    With no ``path`` and mini_trainer ``flags`` the base is :data:`MINI_TRAINER_BASE` instead of
    the embedded quickstart, so flags alone describe a complete run.
    """
    if path is None and flags:
        raw = copy.deepcopy(MINI_TRAINER_BASE)
    else:
        raw = read_yaml_file(path if path is not None else DEFAULT_CONFIG)
    if flags:
        raw = apply_mini_trainer_flags(raw, flags)
    return apply_overrides(raw, overrides)


# --------------------------------------------------------------------------- validation


def validate_config(raw: Any) -> list[str]:
    """Every problem in the config, as dotted-key messages; ``[]`` when it is valid."""
    if not isinstance(raw, Mapping):
        return [f"the config must be a mapping, got {type(raw).__name__}"]
    raw, p = canonical_model(raw)
    p += unknown_keys(raw, TOP_KEYS, "")
    p += model_problems(raw.get("model"), raw.get("quantization"))
    # The folders and hub names the config points at (model, tokenizer, reference, checkpoint):
    # a mistyped path is one more line here, not a traceback from the loader later.
    p += reference_problems(raw)
    # An empty YAML section (``training:``) parses as None: treat it as absent.
    p += _training_problems(raw.get("training") or {})
    loss_type, loss_problems = _loss_problems(raw.get("loss") or {"type": "sft"})
    p += loss_problems
    if "dataset" not in raw and not verifiers_source.names_verifiers(raw):
        p.append("dataset: required (e.g. dataset: {jsonl: train.jsonl, tokenize: {type: sft}})")
    for where in ("dataset", "eval_dataset"):
        if verifiers_source.is_verifiers_section(raw.get(where)):
            p += verifiers_source.section_problems(raw, raw[where], where)
        elif where in raw:
            p += source_problems(raw[where], where, extra_keys=("tokenize",), check_hub=True)
            inherited = where == "eval_dataset" and "tokenize" not in (raw[where] or {})
            if isinstance(raw[where], Mapping) and not (inherited and "dataset" in raw):
                # An eval_dataset without its own tokenize reuses dataset's (checked once).
                p += _tokenize_problems(tokenize_section(raw, where), where, loss_type)
    if raw.get("peft") is not None:
        p += _peft_problems(raw["peft"])
    p += _callback_problems(raw.get("callbacks"), has_eval="eval_dataset" in raw)
    save_to = raw.get("save_to")
    if save_to is True or check_type("save_to", save_to, str | bool | None):
        p.append(
            f"save_to: a folder, null (default: <output_dir>/final) or false (do not save); "
            f"got {save_to!r}"
        )
    p += section_problems(raw.get("wandb"), "wandb", WANDB_KEYS)
    return p


def _training_problems(training: Any) -> list[str]:
    if not isinstance(training, Mapping):
        return [f"training: expected a mapping, got {type(training).__name__} {training!r}"]
    names = [f.name for f in dataclasses.fields(TrainingConfig)]
    trl = [h for k, v in training.items() if k not in names and (h := trl_hint(k, v)) is not None]
    rest = {k: v for k, v in training.items() if k in names or k not in TRL_NAMES}
    p = trl + unknown_keys(rest, names, "training")
    try:
        TrainingConfig(**{k: v for k, v in training.items() if k in names})
    except ConfigError as exc:
        p += [m if m.startswith("training.") else f"training.{m}" for m in exc.problems]
    return p


def _loss_problems(loss: Any) -> tuple[str | None, list[str]]:
    p = section_problems(
        loss,
        "loss",
        {"type": str, "args": dict | None, "ref_model": str | None, "cache_reference": bool},
    )
    if p:
        return None, p
    if "type" not in loss:
        return None, ["loss.type: required (e.g. sft, or package.module:MyLoss)"]
    args = dict(loss.get("args") or {})
    if "ref_model" in args:
        p.append(
            "loss.args.ref_model: give the reference as loss.ref_model (a path, a hub name, or "
            f"{REF_MODEL_COPY!r} for a frozen copy of the starting policy)"
        )
    if loss.get("ref_model") and not loss.get("cache_reference"):
        args["ref_model"] = None  # checked against the loss's signature like any argument
    if args.get("engine") is not None:  # a name or {type, args}: vLLM installed, known arguments
        p += engine_problems(args["engine"], "loss.args.engine")
    checked = _resolve_and_check(loss["type"], registry.LOSSES, "loss.type", args, "loss.args")
    p += [_trl_answer(m, args, "loss.args") for m in checked]
    if "reward_funcs" in args and not (args.get("verifiers") and args["reward_funcs"] == []):
        p += _reward_problems(args["reward_funcs"], args.get("reward_weights"))
    return loss["type"], p


def _trl_answer(problem: str, args: Mapping[str, Any], where: str) -> str:
    """An unknown argument that is one of TRL's names (``max_completion_length``) answered with
    the key that does it here, as in ``training:``; other problems as they are."""
    for key, value in args.items():
        if problem.startswith(f"{where}.{key}: unknown key"):
            return trl_hint(key, value, where) or problem
    return problem


def _reward_problems(funcs: Any, weights: Any) -> list[str]:
    """Short names, ``package.module:function`` specs and ``{type, args}`` entries resolved now
    (importing a spec runs its module, as for ``loss.type``; options are checked by building the
    reward), with the weights, as the online methods will at set-up."""
    if weights is not None and not isinstance(weights, list):
        return [f"loss.args.reward_weights: expected a list of numbers, got {weights!r}"]
    if not isinstance(funcs, str | list | Mapping):
        return [
            "loss.args.reward_funcs: expected a name, a {type: <name>, args: {...}} entry or a "
            f"list of them, got {funcs!r}"
        ]
    try:
        resolve_reward_funcs(funcs, weights)
    except ConfigError as exc:
        return [f"loss.args.{m}" for m in exc.problems]
    return []


def _tokenize_problems(tok: Any, where: str, loss_type: str | None) -> list[str]:
    if tok is None:
        if loss_type in registry.TOKENIZERS:
            return []  # defaults to the tokenizer registered under the loss's name
        return [
            f"{where}.tokenize.type: required because loss.type {loss_type!r} has no "
            f"same-named tokenizer; known: {', '.join(sorted(registry.TOKENIZERS))}"
        ]
    if not isinstance(tok, Mapping):
        return [f"{where}.tokenize: expected a mapping like {{type: sft}}, got {tok!r}"]
    kwargs = {k: v for k, v in tok.items() if k != "type"}
    name = tok.get("type", loss_type)
    if name is None:
        return [f"{where}.tokenize.type: required"]
    return _resolve_and_check(
        name,
        registry.TOKENIZERS,
        f"{where}.tokenize.type",
        kwargs,
        f"{where}.tokenize",
        skip_first=True,
        reserved=TOKENIZE_RESERVED,
    )


def _peft_problems(peft: Any) -> list[str]:
    if not isinstance(peft, Mapping):
        return [f"peft: expected a mapping of LoraConfig arguments, got {peft!r}"]
    try:
        from peft import LoraConfig
    except ImportError as exc:
        return [f"peft: cannot import peft.LoraConfig: {exc}"]
    p = []
    if str(peft.get("type", PEFT_TYPES[0])).lower() not in PEFT_TYPES:
        p.append(f"peft.type: {peft['type']!r} is not supported; supported: {list(PEFT_TYPES)}")
    names = [f.name for f in dataclasses.fields(LoraConfig)]
    return p + unknown_keys({k: v for k, v in peft.items() if k != "type"}, names, "peft")


def _callback_problems(callbacks: Any, has_eval: bool) -> list[str]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, list):
        return [f"callbacks: expected a list of {{type, args}} mappings, got {callbacks!r}"]
    p: list[str] = []
    for i, cb in enumerate(callbacks):
        where = f"callbacks[{i}]"
        errs = section_problems(cb, where, {"type": str, "args": dict | None})
        if errs or "type" not in cb:
            p += errs or [f"{where}.type: required (e.g. exact_match)"]
            continue
        args = dict(cb.get("args") or {})
        for key, value in args.items():
            if is_dataset_ref(value):
                p += source_problems(
                    value["dataset"], f"{where}.args.{key}.dataset", check_hub=True
                )
        if cb["type"] == "exact_match" and "rows" not in args:
            if not has_eval:
                p.append(
                    f"{where}.args.rows: required when there is no eval_dataset "
                    "(give rows: {dataset: {jsonl: ...}})"
                )
            args["rows"] = []  # filled from eval_dataset's raw rows at build time
        p += _resolve_and_check(
            cb["type"], registry.CALLBACKS, f"{where}.type", args, f"{where}.args"
        )
        with contextlib.suppress(ConfigError):  # an unknown type is reported just above
            cls = registry.resolve(cb["type"], registry.CALLBACKS, f"{where}.type")
            p += [f"{where}.type: {q}" for q in hook_problems(cls)]
    return p


def tokenize_section(raw: Mapping[str, Any], where: str) -> Any:
    """The ``tokenize`` mapping for ``where``; ``eval_dataset`` inherits ``dataset``'s."""
    section = raw.get(where) or {}
    tok = section.get("tokenize") if isinstance(section, Mapping) else None
    if tok is None and where == "eval_dataset" and isinstance(raw.get("dataset"), Mapping):
        tok = raw["dataset"].get("tokenize")
    return tok


def is_dataset_ref(value: Any) -> bool:
    """True for a callback argument written as ``{dataset: <source section>}``."""
    return isinstance(value, Mapping) and set(value) == {"dataset"}


def _resolve_and_check(
    name: str,
    table: Mapping[str, str],
    kind: str,
    kwargs: Mapping[str, Any],
    where: str,
    skip_first: bool = False,
    reserved: Sequence[str] = (),
) -> list[str]:
    """Resolve ``name`` and check ``kwargs`` against its signature (unknown/missing args)."""
    try:
        target = registry.resolve(name, table, kind)
    except ConfigError as exc:
        return exc.problems
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return []  # builtins without a signature: nothing to check
    if skip_first and params:
        params = params[1:]  # the row passed positionally
    p = [f"{where}.{k}: set by grimoire, do not give it" for k in kwargs if k in reserved]
    if not any(q.kind is q.VAR_KEYWORD for q in params):
        names = [q.name for q in params if q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
        p += unknown_keys({k: None for k in kwargs if k not in reserved}, names, where)
    required = [
        q.name
        for q in params
        if q.default is q.empty
        and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
        and q.name not in kwargs
        and q.name not in reserved
        and q.name != "max_length"
    ]
    p += [f"{where}.{r}: required by {name}" for r in required]
    return p


__all__ = [
    "DEFAULT_CONFIG",
    "MINI_TRAINER_BASE",
    "PEFT_TYPES",
    "REF_MODEL_COPY",
    "TINY_PREFIX",
    "ConfigLoader",
    "apply_mini_trainer_flags",
    "apply_overrides",
    "check_config",
    "is_dataset_ref",
    "load_config",
    "parse_override",
    "parse_yaml",
    "section_problems",
    "tokenize_section",
    "validate_config",
]


def check_config(raw: Mapping[str, Any]) -> TrainingConfig:
    """Raise one :class:`ConfigError` with every problem; return the TrainingConfig if valid."""
    problems = validate_config(raw)
    if problems:
        raise ConfigError(problems)
    return TrainingConfig.from_dict(dict(raw.get("training") or {}), hint=trl_hint)
