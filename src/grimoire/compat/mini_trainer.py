"""mini_trainer's command-line flags on ``grimoire train``: one table, the parser and the mapping.

Stage: between reading the YAML and applying ``--set``. :data:`MINI_TRAINER_FLAGS` is the one
list of these flags; :func:`add_mini_trainer_flags` builds the argparse group from it,
:func:`apply_mini_trainer_flags` maps the given flags onto the raw config, and
:func:`markdown_table` renders it as the flag table of ``docs/cli.md`` (a test fails when the
doc and this table differ). Nothing here loads anything.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grimoire.config.training import LR_SCHEDULERS, TrainingConfig
from grimoire.errors import ConfigError


@dataclass(frozen=True)
class MiniTrainerFlag:
    """One mini_trainer flag and what it becomes in grimoire's schema.

    ``key`` is the dotted config key the flag sets (its value passed through ``convert``);
    ``None`` marks a flag whose effect needs more of the config (``--batch-size``,
    ``--save-final-checkpoint``), handled by name in :func:`apply_mini_trainer_flags`. ``kind``
    ``bool`` is a switch (``store_true``). ``becomes`` is the doc table's right column (Markdown);
    left empty it reads ``key: METAVAR`` (``key: true`` for a switch), followed by ``note``.
    """

    flag: str
    kind: type
    key: str | None
    metavar: str | None = None
    becomes: str = ""
    #: A remark after the generated right column (when ``becomes`` is empty).
    note: str = ""
    convert: Callable[[Any], Any] | None = None
    #: Also sets ``training.log_with: wandb``.
    wandb: bool = False

    @property
    def dest(self) -> str:
        """The argparse dest, which is also the key of the ``flags`` mapping."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def doc(self) -> str:
        """The right column of this flag's row in ``docs/cli.md``."""
        if self.becomes:
            return self.becomes
        value = "true" if self.kind is bool else self.metavar
        text = f"`{self.key}: {value}`" + (f" {self.note}" if self.note else "")
        return f"{text} and `training.log_with: wandb`" if self.wandb else text


def _pretokenized_source(path: str) -> dict[str, Any]:
    # mini_trainer reads pre-tokenized JSONL (input_ids/labels[/len]).
    return {"jsonl": path, "tokenize": {"type": "pretokenized"}}


#: The mini_trainer flags, in the order of ``docs/cli.md``'s table.
MINI_TRAINER_FLAGS: tuple[MiniTrainerFlag, ...] = (
    MiniTrainerFlag("--model-name-or-path", str, "model.pretrained", "M"),
    MiniTrainerFlag(
        "--data-path",
        str,
        "dataset",
        "P",
        "`dataset: {jsonl: P, tokenize: {type: pretokenized}}` (replaces the section; rows hold "
        "`input_ids`, `labels`, optional `len`)",
        convert=_pretokenized_source,
    ),
    MiniTrainerFlag("--output-dir", str, "training.output_dir", "D"),
    MiniTrainerFlag(
        "--batch-size",
        int,
        None,
        "N",
        "`training.batch_size: N / (WORLD_SIZE x gradient_accumulation_steps)` (see below)",
    ),
    MiniTrainerFlag("--max-tokens-per-gpu", int, "training.max_tokens_per_device", "T"),
    MiniTrainerFlag("--learning-rate", float, "training.learning_rate", "LR"),
    MiniTrainerFlag("--num-warmup-steps", int, "training.warmup_steps", "W"),
    MiniTrainerFlag(
        "--lr-scheduler", str, "training.lr_scheduler", "S", note=f"({', '.join(LR_SCHEDULERS)})"
    ),
    MiniTrainerFlag("--seed", int, "training.seed", "S"),
    MiniTrainerFlag("--max-epochs", int, "training.num_epochs", "E"),
    MiniTrainerFlag(
        "--max-steps",
        int,
        "training.max_steps",
        "K",
        note='(`0`, mini_trainer\'s "no limit", becomes `null`)',
        convert=lambda steps: steps or None,
    ),
    MiniTrainerFlag("--use-liger-kernels", bool, "training.use_liger"),
    MiniTrainerFlag("--osft", bool, "training.osft"),
    MiniTrainerFlag("--osft-unfreeze-rank-ratio", float, "training.osft_unfreeze_rank_ratio", "R"),
    MiniTrainerFlag(
        "--distributed", str, "training.distributed", "MODE", note="(`ddp` or `fsdp2`)"
    ),
    MiniTrainerFlag("--save-final-checkpoint", bool, None, becomes="`save_to: <output_dir>/final`"),
    MiniTrainerFlag("--checkpoint-at-epoch", bool, "training.save_on_epoch_end"),
    MiniTrainerFlag("--wandb-project", str, "wandb.project", "P", wandb=True),
    MiniTrainerFlag("--wandb-entity", str, "wandb.entity", "E", wandb=True),
    MiniTrainerFlag("--wandb-run-name", str, "training.run_name", "N", wandb=True),
)

#: The argparse dests of :data:`MINI_TRAINER_FLAGS`.
MINI_TRAINER_DESTS: tuple[str, ...] = tuple(f.dest for f in MINI_TRAINER_FLAGS)

#: The base config when only mini_trainer flags are given: mini_trainer's own defaults
#: (one epoch, no per-epoch checkpoints, no warmup unless asked) on pre-tokenized data.
MINI_TRAINER_BASE: dict[str, Any] = {
    "loss": {"type": "sft"},
    "training": {"num_epochs": 1, "save_on_epoch_end": False, "warmup_ratio": 0.0},
}


def add_mini_trainer_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of :data:`MINI_TRAINER_FLAGS` to ``parser`` (default ``None``: not given)."""
    group = parser.add_argument_group(
        "mini_trainer-compatible flags (applied after the YAML, before --set)"
    )
    for f in MINI_TRAINER_FLAGS:
        help_text = f.doc.replace("`", "")
        if f.kind is bool:
            group.add_argument(f.flag, action="store_true", default=None, help=help_text)
        else:
            group.add_argument(f.flag, type=f.kind, default=None, metavar=f.metavar, help=help_text)


def markdown_table() -> str:
    """The flag table of ``docs/cli.md``, rendered from :data:`MINI_TRAINER_FLAGS`."""
    rows = ["| flag | becomes |", "|---|---|"]
    for f in MINI_TRAINER_FLAGS:
        usage = f"{f.flag} {f.metavar}" if f.metavar else f.flag
        rows.append(f"| `{usage}` | {f.doc} |")
    return "\n".join(rows)


def apply_mini_trainer_flags(
    raw: dict[str, Any], flags: Mapping[str, Any], world_size: int | None = None
) -> dict[str, Any]:
    """A copy of ``raw`` with mini_trainer-style flags mapped onto the schema.

    ``flags`` maps argparse dests (``batch_size``, ``data_path``, ...) to values; ``None``
    means "not given". ``--batch-size`` is mini_trainer's *global* batch (samples per optimizer
    step): it becomes ``training.batch_size = N / (world_size * gradient_accumulation_steps)``
    with ``world_size`` from ``$WORLD_SIZE`` (default 1). See docs/cli.md for the full table.
    """
    raw = copy.deepcopy(raw)
    given = {k: v for k, v in flags.items() if v is not None}

    def put(dotted: str, value: Any) -> None:
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value

    for f in MINI_TRAINER_FLAGS:
        if f.key is not None and f.dest in given:
            value = given[f.dest]
            put(f.key, f.convert(value) if f.convert else value)
    if any(f.wandb and f.dest in given for f in MINI_TRAINER_FLAGS):
        put("training.log_with", "wandb")
    if given.get("save_final_checkpoint"):
        out = raw.get("training", {}).get("output_dir", TrainingConfig.output_dir)
        put("save_to", str(Path(out) / "final"))
    if "batch_size" in given:
        world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        accum = raw.get("training", {}).get("gradient_accumulation_steps", 1)
        per_step = world * accum if isinstance(accum, int) and accum > 0 else world
        global_batch = given["batch_size"]
        if global_batch % per_step:
            raise ConfigError(
                [
                    f"--batch-size {global_batch} (global) is not divisible by world_size {world} x "
                    f"gradient_accumulation_steps {accum}"
                ]
            )
        put("training.batch_size", global_batch // per_step)
    return raw


__all__ = [
    "MINI_TRAINER_BASE",
    "MINI_TRAINER_DESTS",
    "MINI_TRAINER_FLAGS",
    "MiniTrainerFlag",
    "add_mini_trainer_flags",
    "apply_mini_trainer_flags",
    "markdown_table",
]
