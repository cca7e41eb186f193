"""``grimoire train`` / ``python -m grimoire.cli.main``: train from a YAML config, flags, or both.

Usage::

    grimoire train --config run.yaml [--set training.learning_rate=1e-4 ...]
    grimoire validate --config run.yaml        # check the config only; exit 0 or 1
    python -m grimoire.cli.main                   # the embedded quickstart (tiny model, ~minutes)
    grimoire train --model-name-or-path M --data-path data.jsonl --output-dir out ...

The schema (see ``docs/cli.md``) mirrors the Python API: ``model`` -> ``from_pretrained``,
``dataset``/``eval_dataset`` -> :func:`grimoire.rows.sources.load_source` +
:func:`~grimoire.rows.sources.tokenize_dataset`, ``loss`` -> ``registry.LOSSES``, ``peft`` ->
``LoraConfig``, ``training`` -> :class:`TrainingConfig`, ``callbacks`` -> ``registry.CALLBACKS``.

Order of failure: every config problem is reported at once before anything is loaded; then
every data problem (all rows of both datasets) before the model is loaded or a step is run.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grimoire.cli.flags import MINI_TRAINER_DESTS, add_mini_trainer_flags
from grimoire.cli.schema import (
    check_config,
    load_config,
)
from grimoire.errors import GrimoireError
from grimoire.training.records import metrics_path, read_records
from grimoire.training.report import SUMMARY_FILE

COMMANDS = ("train", "validate")
#: Commands with their own module and argument parser: name -> "module:function(argv) -> int".
TOOL_COMMANDS = {
    "plot": "grimoire.tools.plot.cli:main",
    "merge-lora": "grimoire.tools.merge_lora:main",
    "generate": "grimoire.tools.generate:main",
    "estimate-memory": "grimoire.tools.memory.cli:main",
}


SPARK = "_.:-=+*#%@"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """An ASCII sparkline of ``values`` (down-sampled to ``width``; higher = denser glyph)."""
    vals = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not vals:
        return ""
    if len(vals) > width:
        vals = [vals[int(i * len(vals) / width)] for i in range(width)]
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[round((v - lo) / span * (len(SPARK) - 1))] for v in vals)


def summarize(output_dir: str | Path, save_to: str | None) -> str:
    """A short text summary: loss curve, a few rows, final eval metrics, where the model is."""
    records = read_records(output_dir)
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    evals = [r for r in records if r.get("split") == "eval"]
    lines = ["", "== grimoire: training finished =="]
    if train:
        losses = [r["loss"] for r in train]
        lines.append(
            f"train loss  {losses[0]:.4f} -> {losses[-1]:.4f}  "
            f"[{sparkline(losses)}]  (high {max(losses):.3f}, low {min(losses):.3f})"
        )
        picks = sorted({0, len(train) // 3, 2 * len(train) // 3, len(train) - 1})
        lines += [f"  step {train[i]['step']:>6}  loss {train[i]['loss']:.4f}" for i in picks]
    if evals:
        last = evals[-1]
        shown = [
            f"{k.removeprefix('eval/')} {v:.4f}"
            for k, v in last.items()
            if k.startswith("eval/")
            and not k.startswith("eval/num_")  # counts, not quality metrics
            and isinstance(v, int | float)
        ]
        lines.append(f"eval @ step {last.get('step')}: " + ", ".join(shown))
        if "eval/exact_match" in last:
            lines.append(f"held-out exact match: {100 * last['eval/exact_match']:.1f}%")
    lines.append(f"metrics: {metrics_path(output_dir)}")
    if (Path(output_dir) / SUMMARY_FILE).is_file():
        lines.append(f"run summary: {Path(output_dir) / SUMMARY_FILE}")
    lines.append(
        f"model saved to: {save_to}"
        if save_to
        else f"no save_to given; checkpoints (if any) are in {output_dir}"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- argument parsing


def build_parser() -> argparse.ArgumentParser:
    """The argument parser shared by ``train`` and ``validate`` (mini_trainer flags included)."""
    p = argparse.ArgumentParser(
        prog="grimoire",
        description="Train (or validate) a Grimoire run from a YAML config and/or flags. "
        "Commands: train (default), validate. See docs/cli.md.",
    )
    p.add_argument("--config", help="YAML config; default: the embedded quickstart")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override a dotted key, e.g. training.learning_rate=1e-4 (JSON-decoded; "
        "a value that is not valid JSON is kept as a string)",
    )
    p.add_argument(
        "--dry-run",
        "--validate",
        dest="dry_run",
        action="store_true",
        help="validate the config and exit (same as the validate command)",
    )
    p.add_argument(
        "--log-level",
        default=None,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="show grimoire's log messages from this level on (grimoire-rl's flag); default: "
        "warnings only",
    )
    add_mini_trainer_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[str, argparse.Namespace]:
    """``(command, args)``; the command word (``train``/``validate``) is optional."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    args = build_parser().parse_args(argv)
    if args.dry_run:
        command = "validate"
    return command, args


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The raw config for parsed arguments: YAML (or default), then flags, then ``--set``."""
    flags = {d: getattr(args, d) for d in MINI_TRAINER_DESTS if getattr(args, d) is not None}
    return load_config(args.config, args.overrides, flags)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``grimoire``); returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOL_COMMANDS:
        # The tool's module is imported only when its command is given.
        module, _, function = TOOL_COMMANDS[argv[0]].partition(":")
        return getattr(importlib.import_module(module), function)(argv[1:])
    command, args = parse_args(argv)
    if args.log_level:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("grimoire").setLevel(args.log_level)
    try:
        raw = config_from_args(args)
        if command == "validate":
            check_config(raw)
            print(f"OK: {args.config or 'embedded default config'} is valid")
            return 0
        # Imported when a run starts: `grimoire --help` and `validate` never load the model stack.
        from grimoire.cli.run import build_run

        run = build_run(raw)
        # For the model card: how to reproduce this run.
        run.trainer.launch = {"command": shlex.join(["grimoire", *argv]), "config": raw}
        run.trainer.train()
        if run.trainer.preempted_by is not None:  # checkpointed; the final model comes later
            if getattr(run.trainer.accelerator, "is_main_process", True):
                print(
                    f"grimoire {command}: stopped by {run.trainer.preempted_by} after step "
                    f"{run.trainer.global_step} with a checkpoint in {run.config.output_dir}; "
                    "resume with the same command plus "
                    "--set training.resume_from_checkpoint=latest",
                    file=sys.stderr,
                )
            run.trainer.close()
            return 0
        if run.save_to:
            run.trainer.save_model(run.save_to)
        if getattr(run.trainer.accelerator, "is_main_process", True):
            print(summarize(run.config.output_dir, run.save_to))
        run.trainer.close()
        return 0
    except GrimoireError as exc:
        print(f"grimoire {command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
