"""TRL's ``TrainingArguments`` / ``SFTConfig`` / ``DPOConfig`` / ``GRPOConfig`` names that people
coming from TRL write in a ``training:`` section (or in ``loss.args``), each answered with the key
and value that do it here.

They are not accepted silently as aliases: several differ in meaning or shape (``bf16: true`` is
one value of ``mixed_precision``; ``eval_strategy: epoch`` has no step count), and a config
that says one thing and runs another is what the up-front checks exist to prevent. The error
names the exact key (and value) to write instead, and that replacement is itself a valid config
(tests/test_trl_user_walls.py feeds every entry's examples back through validation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import yaml

from grimoire.config.training import LR_SCHEDULERS, TRACKERS


class Choose(NamedTuple):
    """A replacement TRL's value does not determine: the hint shows ``text`` where the value goes
    (e.g. ``<N>``); ``example`` is a value that text stands for (the tests validate it)."""

    text: str
    example: Any


class At(NamedTuple):
    """A replacement at another key than the entry's ``target`` (for some of TRL's values)."""

    target: str
    value: Any


@dataclass(frozen=True)
class TrlName:
    """What one of TRL's names is here.

    ``target``: the dotted key that does it (``training.batch_size``, ``loss.args.max_new_tokens``).
    ``value``: TRL's value -> the value to write (a :class:`Choose` when it cannot be derived, an
    :class:`At` when that value of TRL's is another key here).
    ``note``: a few words on what differs. ``examples``: TRL values the tests turn into
    replacements and validate; ``loss``: the ``loss.type`` whose argument ``target`` is.
    """

    target: str
    value: Callable[[Any], Any] = lambda v: v
    note: str = ""
    examples: tuple[Any, ...] = (1,)
    loss: str = "sft"


# TRL's optimizer names -> ours (several of TRL's are one of ours); tests/test_trl_user_walls.py
# checks every replacement against the real validation, so an entry that drifts fails there.
_OPTIMIZERS = {
    "adamw": "adamw",
    "adamw_torch": "adamw_torch",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw_hf",
    "adamw_8bit": "adamw_8bit",
    "adamw_bnb_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "adafactor": "adafactor",
    "sgd": "sgd",
}


def _one_of(choices: tuple[str, ...] | Mapping[str, str]) -> Callable[[Any], Any]:
    """TRL's value when it is one of ours (mapped where TRL's spelling differs), else a choice."""
    table = choices if isinstance(choices, Mapping) else {c: c for c in choices}
    first = next(iter(table.values()))
    return lambda v: table.get(
        v, Choose(f"one of {', '.join(dict.fromkeys(table.values()))}", first)
    )


def _mixed_precision(kind: str) -> Callable[[Any], Any]:
    # 'no', not auto: TRL's false means full precision (auto may pick bf16).
    return lambda v: kind if v is True else "no"


def _trackers(value: Any) -> Any:
    """``report_to``: "none" (TRL's "nothing") is null here; "all" has no equivalent."""
    names = [value] if isinstance(value, str) or value is None else list(value)
    if all(n in (None, "none") for n in names):
        return None
    kept = [n for n in names if n in TRACKERS]
    if not kept or len(kept) < len(names):  # "all", or a tracker grimoire does not log to
        return Choose(f"one of {', '.join(TRACKERS)}, a list of them, or null", "wandb")
    return kept[0] if len(kept) == 1 else kept


def _steps(example: int) -> Callable[[Any], Any]:
    """A TRL ``*_strategy``: "no" is null (off) here; any other is a count of optimizer steps."""
    return lambda v: None if v == "no" else Choose("<N>", example)


def _save(value: Any) -> Any:
    """``save_strategy``: "epoch" and "no" are ``save_on_epoch_end`` here, "steps" a count."""
    if value in ("epoch", "no"):
        return At("training.save_on_epoch_end", value == "epoch")
    return Choose("<N>", 500)


_STEPS_NOTE = "counted in optimizer steps"

#: TRL name -> what it is here.
TRL_NAMES: dict[str, TrlName] = {
    # --- TrainingArguments
    "per_device_train_batch_size": TrlName("training.batch_size", examples=(8,)),
    "per_device_eval_batch_size": TrlName("training.eval_batch_size", examples=(8,)),
    "train_batch_size": TrlName("training.batch_size", examples=(8,)),
    "num_train_epochs": TrlName("training.num_epochs", examples=(2,)),
    "bf16": TrlName("training.mixed_precision", _mixed_precision("bf16"), examples=(True, False)),
    "fp16": TrlName("training.mixed_precision", _mixed_precision("fp16"), examples=(True, False)),
    "lr_scheduler_type": TrlName(
        "training.lr_scheduler", _one_of(LR_SCHEDULERS), examples=("cosine", "polynomial")
    ),
    "optim": TrlName(
        "training.optimizer",
        _one_of(_OPTIMIZERS),
        examples=("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "lion_32bit"),
    ),
    "report_to": TrlName(
        "training.log_with",
        _trackers,
        examples=("none", None, [], "wandb", ["wandb", "tensorboard"], "all", "comet_ml"),
    ),
    "disable_tqdm": TrlName("training.progress_bar", lambda v: not v, examples=(True, False)),
    "max_seq_length": TrlName("training.max_length", examples=(1024,)),
    "use_liger_kernel": TrlName("training.use_liger", examples=(True,)),
    "packing": TrlName(
        "training.padding_free",
        note="whole samples packed with no attention across them",
        examples=(True, False),
    ),
    "eval_strategy": TrlName(
        "training.eval_steps", _steps(50), _STEPS_NOTE, ("steps", "epoch", "no")
    ),
    "evaluation_strategy": TrlName("training.eval_steps", _steps(50), _STEPS_NOTE, ("steps", "no")),
    "save_strategy": TrlName("training.save_steps", _save, _STEPS_NOTE, ("steps", "epoch", "no")),
    "logging_strategy": TrlName(
        "training.logging_steps", lambda v: Choose("<N>", 10), _STEPS_NOTE, ("steps",)
    ),
    # --- the methods' settings TRL keeps in its config: the loss's arguments here
    "beta": TrlName("loss.args.beta", examples=(0.1,), loss="dpo"),
    "loss_type": TrlName("loss.args.loss_type", examples=("sigmoid",), loss="dpo"),
    "label_smoothing": TrlName("loss.args.label_smoothing", examples=(0.1,), loss="dpo"),
    "num_generations": TrlName("loss.args.num_generations", examples=(8,), loss="grpo"),
    "max_completion_length": TrlName(
        "loss.args.max_new_tokens",
        note="the sampled completions' length; a DPO/SFT row's length is training.max_length",
        examples=(256,),
        loss="grpo",
    ),
    "num_iterations": TrlName("loss.args.num_iterations", examples=(2,), loss="grpo"),
    "epsilon": TrlName("loss.args.epsilon", examples=(0.2,), loss="grpo"),
    "epsilon_high": TrlName("loss.args.epsilon_high", examples=(0.28,), loss="grpo"),
    "temperature": TrlName("loss.args.temperature", examples=(0.7,), loss="grpo"),
    "top_p": TrlName("loss.args.top_p", examples=(0.9,), loss="grpo"),
    "top_k": TrlName("loss.args.top_k", examples=(50,), loss="grpo"),
    "scale_rewards": TrlName("loss.args.scale_rewards", examples=("group",), loss="grpo"),
    "reward_weights": TrlName("loss.args.reward_weights", examples=([1.0],), loss="grpo"),
    "generation_batch_size": TrlName("loss.args.generation_batch_size", examples=(8,), loss="grpo"),
    # --- the data's settings: the tokenize section's arguments here
    "max_prompt_length": TrlName("dataset.tokenize.max_prompt_length", examples=(512,)),
    "dataset_text_field": TrlName("dataset.tokenize.text_field", examples=("text",)),
}


def replacement(key: str, value: Any) -> tuple[str, Any]:
    """``(dotted key here, value to write)`` for TRL's ``key: value`` (a :class:`Choose` value
    when TRL's does not determine ours)."""
    name = TRL_NAMES[key]
    ours = name.value(value)
    return (ours.target, ours.value) if isinstance(ours, At) else (name.target, ours)


def _scalar(value: Any) -> str:
    """``value`` as YAML writes it in a flow mapping ('no' quoted, None as null, lists inline)."""
    if isinstance(value, Choose):
        return value.text
    return (
        yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n...\n").strip()
    )


def written(key: str, value: Any, where: str = "training") -> str:
    """The YAML to write for TRL's ``key: value`` met in section ``where``: the bare
    ``key: value`` within that section, else the nested mapping from the config's top."""
    target, ours = replacement(key, value)
    section, _, leaf = target.rpartition(".")
    if section == where:
        return f"{leaf}: {_scalar(ours)}"
    text = f"{leaf}: {_scalar(ours)}"
    for part in reversed(section.split(".")):  # loss: {args: {max_new_tokens: 256}}
        text = f"{part}: {{{text}}}"
    return text


def trl_hint(key: str, value: Any, where: str = "training") -> str | None:
    """The problem for TRL's ``key`` given in section ``where``, naming what to write instead;
    None when ``key`` is not one of TRL's names, or is already the right key there."""
    if key not in TRL_NAMES or TRL_NAMES[key].target == f"{where}.{key}":
        return None
    target, note = replacement(key, value)[0], TRL_NAMES[key].note
    note = f" ({note})" if note and target == TRL_NAMES[key].target else ""
    return (
        f"{where}.{key}: TRL's name; here it is {target}: write {written(key, value, where)}{note}"
    )


__all__ = ["TRL_NAMES", "At", "Choose", "TrlName", "replacement", "trl_hint", "written"]
