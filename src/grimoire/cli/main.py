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
import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grimoire.cli.flags import MINI_TRAINER_DESTS, add_mini_trainer_flags
from grimoire.cli.model import TINY_PREFIX, canonical_model, load_model, load_tokenizer
from grimoire.cli.schema import (
    REF_MODEL_COPY,
    is_dataset_ref,
    load_config,
    tokenize_section,
    validate_config,
)
from grimoire.config import registry
from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError, DataError, GrimoireError
from grimoire.rows.sources import load_source, tokenize_dataset
from grimoire.training.report import read_records

COMMANDS = ("train", "validate")
#: Commands with their own module and argument parser: name -> "module:function(argv) -> int".
TOOL_COMMANDS = {
    "plot": "grimoire.tools.plot:main",
    "merge-lora": "grimoire.tools.common:merge_lora_main",
    "generate": "grimoire.tools.common:generate_main",
}


@dataclass
class Run:
    """Everything :func:`build_run` produced; ``trainer.train()`` is the only step left."""

    trainer: Any
    config: TrainingConfig
    save_to: str | None


# --------------------------------------------------------------------------- building


def check_config(raw: Mapping[str, Any]) -> TrainingConfig:
    """Raise one :class:`ConfigError` with every problem; return the TrainingConfig if valid."""
    problems = validate_config(raw)
    if problems:
        raise ConfigError(problems)
    return TrainingConfig.from_dict(dict(raw.get("training") or {}))


def build_run(raw: Mapping[str, Any]) -> Run:
    """Validate ``raw``, then load tokenizer, data, callbacks, loss and model into a trainer.

    Data is loaded and tokenized before the model so bad rows fail fast and cheaply.
    """
    config = check_config(raw)
    raw, _ = canonical_model(raw)  # earlier spellings moved (check_config warned about them)
    model_cfg, quantization = raw["model"], raw.get("quantization")
    model_path = _materialize_model(model_cfg["pretrained"], config.output_dir)
    tokenizer = load_tokenizer(model_cfg, model_path)

    raw_eval_rows: list[dict[str, Any]] | None = None
    datasets: dict[str, Any] = {}
    problems: list[str] = []
    for where in ("dataset", "eval_dataset"):
        if where not in raw:
            continue
        try:
            source = {k: v for k, v in raw[where].items() if k != "tokenize"}
            rows = load_source(source, where)
            if where == "eval_dataset":
                raw_eval_rows = [dict(r) for r in rows]
            datasets[where] = tokenize(rows, raw, where, tokenizer, config.max_length)
        except DataError as exc:
            problems += exc.problems
    callbacks = build_callbacks(raw.get("callbacks") or [], raw_eval_rows, problems)
    if problems:
        raise DataError(problems, title="invalid data (nothing was loaded or trained)")

    loss_cfg = raw.get("loss") or {"type": "sft"}
    loss_cls = registry.resolve(loss_cfg["type"], registry.LOSSES, "loss.type")
    model_kind = getattr(loss_cls, "model_kind", "causal_lm")
    ref_spec, cache = loss_cfg.get("ref_model"), loss_cfg.get("cache_reference")
    ref_path = ref_spec if ref_spec != REF_MODEL_COPY else None
    ref_model = None
    if ref_path or cache:
        # Default reference for caching: the starting policy itself (the usual DPO reference,
        # and what "copy" means).
        ref_path = _materialize_model(ref_path or model_path, config.output_dir)
        ref_model = load_model(model_cfg, ref_path, model_kind, quantization)
    args = dict(loss_cfg.get("args") or {})
    if ref_spec == REF_MODEL_COPY and not cache:
        args["ref_model"] = REF_MODEL_COPY  # the loss freezes a copy of the policy it trains
    elif ref_model is not None and not cache:
        args["ref_model"] = ref_model
    try:
        loss_fn = loss_cls(**args)
    except (TypeError, ValueError) as exc:
        raise ConfigError([f"loss: {loss_cfg['type']}: {exc}"]) from exc
    if loss_cfg.get("cache_reference"):
        datasets = {k: cache_reference(ref_model, v, loss_fn, config) for k, v in datasets.items()}
        del ref_model

    model = load_model(model_cfg, model_path, model_kind, quantization)
    peft_config = build_peft(raw.get("peft"))
    _export_wandb_env(raw.get("wandb") or {})

    from grimoire.training.trainer import GrimoireTrainer

    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tokenizer,
        config=config,
        loss_fn=loss_fn,
        train_dataset=datasets["dataset"],
        eval_dataset=datasets.get("eval_dataset"),
        peft_config=peft_config,
        callbacks=callbacks,
    )
    return Run(trainer=trainer, config=config, save_to=save_path(raw, config))


def save_path(raw: Mapping[str, Any], config: TrainingConfig) -> str | None:
    """Where the final model goes: ``save_to``; absent or null -> ``<output_dir>/final`` (as in
    grimoire-rl); ``false`` -> not saved (the checkpoints, if any, remain)."""
    save_to = raw.get("save_to")
    if save_to is False:
        return None
    return save_to or str(Path(config.output_dir) / "final")


def tokenize(rows: Any, raw: Mapping[str, Any], where: str, tokenizer: Any, max_length: int):
    """Tokenize a loaded source with its ``tokenize`` section (default: the loss's tokenizer)."""
    tok = dict(tokenize_section(raw, where) or {})
    loss_type = (raw.get("loss") or {"type": "sft"})["type"]
    name = tok.pop("type", loss_type)
    fn = registry.resolve(name, registry.TOKENIZERS, f"{where}.tokenize.type")
    tok.setdefault("max_length", max_length)
    kwargs = {"tokenizer": tokenizer, **tok}
    if getattr(fn, "dataset_level", False):  # e.g. pretrain blocks: rows are regrouped
        return fn(list(rows), **_accepted(fn, kwargs))
    return tokenize_dataset(rows, fn, source_name=where, **_accepted(fn, kwargs))


def _accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop the CLI-supplied ``tokenizer``/``max_length`` when ``fn`` does not take them.

    A pre-tokenized loader, say, needs no tokenizer; user-given kwargs were already checked
    against the signature during validation.
    """
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def build_callbacks(
    specs: Sequence[Mapping[str, Any]],
    eval_rows: list[dict[str, Any]] | None,
    problems: list[str],
) -> list[Any]:
    """Instantiate ``callbacks:`` entries; ``{dataset: ...}`` args become lists of raw rows.

    ``exact_match`` without ``rows`` scores the raw (untokenized) ``eval_dataset`` rows. Data
    problems are appended to ``problems`` so they are reported with the datasets' own.
    """
    out = []
    for i, spec in enumerate(specs):
        args = dict(spec.get("args") or {})
        for key, value in args.items():
            if is_dataset_ref(value):
                try:
                    ds = load_source(value["dataset"], f"callbacks[{i}].args.{key}.dataset")
                    args[key] = [dict(r) for r in ds]
                except DataError as exc:
                    problems += exc.problems
        if spec["type"] == "exact_match" and "rows" not in args:
            args["rows"] = eval_rows or []
        cls = registry.resolve(spec["type"], registry.CALLBACKS, f"callbacks[{i}].type")
        try:
            out.append(cls(**args))
        except (TypeError, ValueError) as exc:
            problems.append(f"callbacks[{i}] ({spec['type']}): {exc}")
    return out


def _materialize_model(name_or_path: str, output_dir: str) -> str:
    """``tiny:<arch>`` -> build the tiny model into ``<output_dir>/tiny-model``; else as given."""
    if not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    from accelerate import PartialState

    from grimoire.model.prepare import has_accelerator
    from grimoire.model.tiny import save_tiny

    # Saved and reloaded (not used in memory) so the run exercises the real from_pretrained path.
    # Under a multi-process launch one process per node writes it while the others wait.
    path = Path(output_dir) / "tiny-model"
    # cpu= must match the trainer's Accelerator: PartialState is a process-wide singleton and
    # the first one decides; cpu=False on a CPU-only machine would lock every worker into a
    # separate 1-process run instead of one gloo group.
    state = PartialState(cpu=not has_accelerator())
    with state.local_main_process_first():
        if state.is_local_main_process:
            save_tiny(path, arch=name_or_path[len(TINY_PREFIX) :])
    return str(path)


def cache_reference(ref_model: Any, dataset: Any, loss_fn: Any, config: TrainingConfig) -> Any:
    """Precompute reference log-probs into ``dataset`` once (``loss.cache_reference: true``)."""
    import torch

    from grimoire.forward.precomputed import cache_reference_log_probs
    from grimoire.model.precision import decide

    return cache_reference_log_probs(
        ref_model,
        dataset,
        batch_size=config.effective_eval_batch_size,
        fused=getattr(loss_fn, "fused", True),
        reduction=getattr(loss_fn, "logp_reduction", "sum"),
        autocast_dtype=torch.bfloat16 if decide(config.mixed_precision)[0] == "bf16" else None,
        max_length=config.max_length,
    )


def build_peft(section: Mapping[str, Any] | None):
    """A peft ``LoraConfig`` from the ``peft:`` section: ``type: lora`` (the default, and the only
    type) plus ``LoraConfig``'s fields; ``task_type`` defaults to CAUSAL_LM."""
    if not section:
        return None
    from peft import LoraConfig

    kwargs = {k: v for k, v in section.items() if k != "type"}  # type: validated up front
    return LoraConfig(**{"task_type": "CAUSAL_LM", **kwargs})


def _export_wandb_env(section: Mapping[str, Any]) -> None:
    # wandb reads WANDB_PROJECT / WANDB_ENTITY itself; an explicit environment wins.
    for key, env in (("project", "WANDB_PROJECT"), ("entity", "WANDB_ENTITY")):
        if section.get(key):
            os.environ.setdefault(env, str(section[key]))


# --------------------------------------------------------------------------- summary

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
    lines.append(f"metrics: {Path(output_dir) / 'metrics.jsonl'}")
    if (Path(output_dir) / "run_summary.json").is_file():
        lines.append(f"run summary: {Path(output_dir) / 'run_summary.json'}")
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
        import importlib

        module, _, function = TOOL_COMMANDS[argv[0]].partition(":")
        return getattr(importlib.import_module(module), function)(argv[1:])
    command, args = parse_args(argv)
    if args.log_level:
        import logging

        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("grimoire").setLevel(args.log_level)
    try:
        raw = config_from_args(args)
        if command == "validate":
            check_config(raw)
            print(f"OK: {args.config or 'embedded default config'} is valid")
            return 0
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
