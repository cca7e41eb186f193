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

Order of failure: every config problem (paths and hub names included) is reported at once
before anything is loaded; then every data problem (all rows of both datasets) before the model
is loaded or a step is run. Any failure ends in one message (``--log-level DEBUG`` adds the
traceback). The tools (``plot``, ``generate``, ``merge-lora``, ...) are dispatched from
:data:`TOOL_COMMANDS`; ``grimoire --help`` lists them all.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import logging
import math
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grimoire.cli.output import command_output
from grimoire.cli.schema import (
    check_config,
    load_config,
)
from grimoire.cli.wording import yaml_wording
from grimoire.compat.mini_trainer import MINI_TRAINER_DESTS, add_mini_trainer_flags
from grimoire.errors import GrimoireError
from grimoire.training.interrupts import SecondInterrupt, exit_code
from grimoire.training.phases import reporting
from grimoire.training.records import metrics_path, read_records
from grimoire.training.report import SUMMARY_FILE, written_text

logger = logging.getLogger(__name__)

COMMANDS = ("train", "validate")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Commands with their own module and argument parser: name -> "module:function(argv) -> int".
TOOL_COMMANDS = {
    "plot": "grimoire.tools.plot.cli:main",
    "merge-lora": "grimoire.tools.merge_lora:main",
    "generate": "grimoire.tools.generate:main",
    "estimate-memory": "grimoire.tools.memory.cli:main",
    "vllm-serve": "grimoire.tools.vllm_serve:main",
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
            # With an evaluation before training (eval_on_start), the starting model's score
            # too: a fine-tune of a real model is judged by the change, not the end point.
            first = evals[0] if evals[0].get("step") == 0 and len(evals) > 1 else None
            before = (
                f"{100 * first['eval/exact_match']:.1f}% at step 0 -> "
                if first and "eval/exact_match" in first
                else ""
            )
            lines.append(f"held-out exact match: {before}{100 * last['eval/exact_match']:.1f}%")
    lines.append(f"metrics: {metrics_path(output_dir)}")
    summary_file = Path(output_dir) / SUMMARY_FILE
    if summary_file.is_file():
        # What the run left on disk and how large: a checkpoint (optimizer state included) is
        # several times the model, which a user of a real model wants to see before it fills
        # the disk.
        lines += written_text(json.loads(summary_file.read_text(encoding="utf-8")))
        lines.append(f"run summary: {summary_file}")
    lines.append(
        f"model saved to: {save_to}"
        if save_to
        else f"no save_to given; checkpoints (if any) are in {output_dir}"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- argument parsing

#: One line per command for ``grimoire --help``. A command in :data:`TOOL_COMMANDS` that is not
#: here is listed with the first line of its module's docstring, so new commands show up anyway.
COMMAND_SUMMARIES = {
    "train": "train from a YAML config and/or flags (the default command)",
    "validate": "check a config: every problem at once, before anything is loaded",
    "plot": "plot the loss and metrics of one or more runs (PNG or HTML)",
    "generate": "complete a prompt with a saved model or LoRA adapter",
    "merge-lora": "fold a saved LoRA adapter into its base and save a plain model",
    "vllm-serve": "serve sampling with vLLM to trainers using engine: vllm-server",
}
#: What each parser's help ends with.
EXAMPLES = {
    None: (
        "grimoire train --config examples/quickstart.yaml --set training.max_steps=100",
        "grimoire validate --config run.yaml",
    ),
    "train": ("grimoire train --config run.yaml --set training.learning_rate=1e-4",),
    "validate": ("grimoire validate --config run.yaml --set training.max_steps=10",),
}


def command_summary(name: str) -> str:
    """The one-line description of ``name`` (read without importing its module)."""
    if name in COMMAND_SUMMARIES:
        return COMMAND_SUMMARIES[name]
    module = TOOL_COMMANDS[name].partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else ""
        doc = ast.get_docstring(ast.parse(source)) or ""
    except (ImportError, OSError, SyntaxError, ValueError):
        doc = ""
    # "``grimoire x``: does y." -> "does y."
    first = re.sub(r"^``[^`]*``\s*:?\s*", "", doc.strip().split("\n")[0]).rstrip(".")
    return first or f"see grimoire {name} --help"


def commands_text() -> str:
    """The command list of ``grimoire --help``: every command with its one line."""
    names = [*COMMANDS, *TOOL_COMMANDS]
    width = max(map(len, names)) + 3
    return "\n".join(f"  {n:<{width}}{command_summary(n)}" for n in names)


def examples_text(lines: Sequence[str]) -> str:
    return ("example:\n" if len(lines) == 1 else "examples:\n") + "\n".join(
        f"  {line}" for line in lines
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``train``/``validate`` (mini_trainer flags included); ``None``: the
    top-level ``grimoire`` (which trains), whose help lists every command."""
    if command is None:
        description = (
            f"Post-training for LLMs from a YAML config. Commands:\n\n{commands_text()}\n\n"
            "grimoire COMMAND --help shows a command's options. Without a command, grimoire\n"
            "trains: the options below are train's. See docs/cli.md."
        )
    else:
        description = f"grimoire {command}: {COMMAND_SUMMARIES[command]}. See docs/cli.md."
    p = argparse.ArgumentParser(
        prog="grimoire" if command is None else f"grimoire {command}",
        usage="%(prog)s [--config YAML] [--set KEY=VALUE ...] [options]"
        if command
        else "%(prog)s [COMMAND] [--config YAML] [--set KEY=VALUE ...] [options]",
        description=description,
        epilog=examples_text(EXAMPLES[command]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        choices=LOG_LEVELS,
        type=str.upper,
        help="show grimoire's log messages from this level on; INFO or DEBUG also let the "
        "libraries print their progress bars and warnings, and DEBUG shows an error's traceback "
        "(default: warnings only, libraries quiet)",
    )
    add_mini_trainer_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[str, argparse.Namespace]:
    """``(command, args)``; the command word (``train``/``validate``) is optional."""
    argv = list(sys.argv[1:] if argv is None else argv)
    word = argv.pop(0) if argv and argv[0] in COMMANDS else None
    args = build_parser(word).parse_args(argv)
    command = "validate" if args.dry_run else word or "train"
    return command, args


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The raw config for parsed arguments: YAML (or default), then flags, then ``--set``."""
    flags = {d: getattr(args, d) for d in MINI_TRAINER_DESTS if getattr(args, d) is not None}
    return load_config(args.config, args.overrides, flags)


def log_level_of(argv: Sequence[str]) -> str | None:
    """``--log-level X`` / ``--log-level=X`` anywhere in ``argv`` (every command takes it), read
    before the command parses its arguments; ``None`` when absent or not a level."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--log-level" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--log-level="):
            value = arg.partition("=")[2]
        if value is not None and value.upper() in LOG_LEVELS:
            return value.upper()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``grimoire``); returns the process exit code.

    Every failure ends in one message, ``grimoire <command>: <what to fix>``, and exit code 1:
    Grimoire's own errors as they are, any other exception with its type (a user mistake that
    slipped past validation surfaces as a library's error); ``--log-level DEBUG`` logs the
    traceback first.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    level = log_level_of(argv)
    if level:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("grimoire").setLevel(level)
    if argv and argv[0] in TOOL_COMMANDS:
        command, args = argv[0], None
    else:
        command, args = parse_args(argv)  # --help and usage errors exit here, argparse's way
    with command_output(level, uses_datasets=command == "train"):
        try:
            if args is None:  # the tool's module is imported only when its command is given
                module, _, function = TOOL_COMMANDS[command].partition(":")
                return getattr(importlib.import_module(module), function)(argv[1:])
            return _train_or_validate(command, args, argv)
        except GrimoireError as exc:
            return _fail(command, exc, str(exc))
        except KeyboardInterrupt as exc:  # one line, no traceback
            twice = "twice" if isinstance(exc, SecondInterrupt) else "(Ctrl-C)"
            _fail(command, exc, f"interrupted {twice}: aborted at once, without a checkpoint")
            return exit_code("SIGINT")
        except Exception as exc:  # a library's error for a mistake validation missed: one message
            hint = "" if level == "DEBUG" else "\n(rerun with --log-level DEBUG for the traceback)"
            return _fail(command, exc, f"{type(exc).__name__}: {exc}{hint}")


def _fail(command: str, exc: BaseException, message: str) -> int:
    logger.debug("grimoire %s failed; the traceback:", command, exc_info=exc)
    if command in COMMANDS:  # a config run: name the YAML key that fixes it, not the argument
        message = yaml_wording(message)
    print(f"grimoire {command}: {message}", file=sys.stderr)
    return 1


def import_dirs(config: str | None) -> list[str]:
    """Put the config file's folder, then the working directory, first on ``sys.path``, so a
    ``package.module:Name`` spec finds the user's own modules beside the config or where the
    command runs (the ``grimoire`` script, unlike ``python -m``, has neither on the path).
    Importing such a module runs its code, as any spec does. Returns the folders added."""
    folders = [str(Path(config).resolve().parent)] if config else []
    folders.append(str(Path.cwd()))
    added = [f for f in dict.fromkeys(folders) if f not in sys.path]
    sys.path[:0] = added
    return added


def _train_or_validate(command: str, args: argparse.Namespace, argv: Sequence[str]) -> int:
    raw = config_from_args(args)
    import_dirs(args.config)
    config = check_config(raw)  # before the model stack is imported: config mistakes answer at once
    # Imported once the config is valid: `grimoire --help` never loads the model stack.
    from grimoire.cli.run import build_run, check_run

    if command == "validate":
        # Every check train makes before loading weights: tokenizer, data rows, loss, reference.
        check_run(raw, validate_only=True)
        print(f"OK: {args.config or 'embedded default config'} is valid")
        return 0

    # Loading, tokenizing and the reference pass say what they do as they go (a line at each
    # phase's start and end), on a terminal or not: minutes on a real model before step 1.
    with reporting(on=config.progress_bar):
        run = build_run(raw)
    # For the model card: how to reproduce this run.
    run.trainer.launch = {"command": shlex.join(["grimoire", *argv]), "config": raw}
    run.trainer.train()
    if run.trainer.preempted_by is not None:  # checkpointed (the trainer said where and how
        run.trainer.close()  # to resume); the final model comes later: not a success (exit code)
        return exit_code(run.trainer.preempted_by)
    if run.save_to:
        run.trainer.save_model(run.save_to)
    if getattr(run.trainer.accelerator, "is_main_process", True):
        print(summarize(run.config.output_dir, run.save_to))
    run.trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
