"""What ``grimoire train`` builds from a valid config: tokenizer, data, callbacks, method, model and
the trainer (:func:`build_run`). Imported only when a run starts, so ``grimoire --help`` and
``grimoire validate`` never load torch's model stack.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState

from grimoire.cli import verifiers_source
from grimoire.cli.model import TINY_PREFIX, canonical_model, load_model, load_tokenizer
from grimoire.cli.schema import (
    REF_MODEL_COPY,
    check_config,
    is_dataset_ref,
    tokenize_section,
)
from grimoire.columns import columns_of, listed
from grimoire.compat.grimoire_rl_methods import is_peer_prompt_dataset
from grimoire.config import registry
from grimoire.config.training import TrainingConfig
from grimoire.contract.method import Method
from grimoire.errors import ConfigError, DataError, raise_if
from grimoire.forward.precomputed import cache_reference_log_probs
from grimoire.losses.adapter import as_method
from grimoire.losses.base import GrimoireLoss
from grimoire.model.gguf import is_gguf_name, materialize_gguf
from grimoire.model.precision import decide
from grimoire.model.tiny import build_tokenizer, save_tiny
from grimoire.parallel.accelerate import has_accelerator
from grimoire.rows.prompts import tokenize_grpo
from grimoire.rows.sources import (
    PACKAGE_PREFIX,
    LoadedSource,
    load_source,
    read_source,
    resolve_path,
    tokenize_dataset,
)
from grimoire.training.phases import phase
from grimoire.training.trainer import GrimoireTrainer


@dataclass
class Run:
    """Everything :func:`build_run` produced; ``trainer.train()`` is the only step left."""

    trainer: Any
    config: TrainingConfig
    save_to: str | None


# --------------------------------------------------------------------------- building


@dataclass
class Checked:
    """What :func:`check_run` built without loading any weights (``grimoire validate`` stops
    here; ``grimoire train`` goes on from it)."""

    raw: Mapping[str, Any]
    config: TrainingConfig
    model_path: str
    tokenizer: Any
    datasets: dict[str, Any]
    callbacks: list[Any]
    loss_cls: Any
    loss_args: dict[str, Any]
    loss_fn: Any


def check_run(raw: Mapping[str, Any], validate_only: bool = False) -> Checked:
    """Every check ``grimoire train`` makes before it loads weights: the config, the tokenizer,
    every data row, the callbacks, the loss's arguments and whether the loss has the reference
    it needs. Raises one error listing every problem found by the failing stage.
    ``validate_only``: a ``tiny:`` model's tokenizer is built in memory (nothing is written)."""
    config = check_config(raw)
    raw, _ = canonical_model(raw)  # earlier spellings moved (check_config warned about them)
    model_cfg = raw["model"]
    if validate_only and model_cfg["pretrained"].startswith(TINY_PREFIX):
        model_path, tokenizer = model_cfg["pretrained"], build_tokenizer()
    else:
        with phase(f"loading the tokenizer of {model_cfg['pretrained']}"):
            model_path = _materialize_model(
                model_cfg["pretrained"], config.output_dir, model_cfg.get("gguf_file")
            )
            tokenizer = load_tokenizer(model_cfg, model_path)

    raw_eval_rows: list[dict[str, Any]] | None = None
    datasets: dict[str, Any] = {}
    problems: list[str] = []
    vf_env = verifiers_source.environment(raw)  # its dataset and episodes: loaded once
    for where, given in verifiers_source.sections(raw).items():
        try:
            with phase(f"reading and tokenizing {where}"):
                section = {k: v for k, v in given.items() if k != "tokenize"}
                if verifiers_source.is_verifiers_section(section):
                    source = verifiers_source.read(vf_env, section, where)
                else:
                    source = read_source(section, where)
                if where == "eval_dataset":
                    raw_eval_rows = [dict(r) for r in source.dataset]
                datasets[where] = tokenize(
                    source, raw, where, tokenizer, config.max_length, config.truncate_long_samples
                )
        except DataError as exc:
            problems += exc.problems
    callbacks = build_callbacks(raw.get("callbacks") or [], raw_eval_rows, problems)
    if problems:
        raise DataError(problems, title="invalid data (nothing was loaded or trained)")

    loss_cfg: Mapping[str, Any] = raw.get("loss") or {"type": "sft"}
    loss_cls = registry.resolve(loss_cfg["type"], registry.LOSSES, "loss.type")
    args: dict[str, Any] = dict(loss_cfg.get("args") or {})
    if loss_cfg.get("ref_model") == REF_MODEL_COPY and not loss_cfg.get("cache_reference"):
        args["ref_model"] = REF_MODEL_COPY  # the loss freezes a copy of the policy it trains
    if vf_env is not None:
        args["verifiers"] = vf_env
    for key in getattr(loss_cls, "model_args", ()):
        if isinstance(args.get(key), str):  # a GGUF or tiny: source, as model.pretrained is
            args[key] = _materialize_model(args[key], config.output_dir, where=f"loss.args.{key}")
    loss_fn = make_loss(loss_cls, loss_cfg["type"], args)
    method = as_method(loss_fn)
    raise_if(dataset_problems(method, datasets, tokenizer), ConfigError)
    raise_if(missing_reference(method, raw, config, datasets), ConfigError)
    return Checked(raw, config, model_path, tokenizer, datasets, callbacks, loss_cls, args, loss_fn)


def make_loss(loss_cls: Any, name: str, args: dict[str, Any]) -> Any:
    """The loss, built and checked against the contract (a custom loss without ``loss_weight``
    is named here, before any weights load)."""
    try:
        loss_fn = loss_cls(**args)
        as_method(loss_fn)
    except (TypeError, ValueError) as exc:
        raise ConfigError([f"loss: {name}: {exc}"]) from exc
    return loss_fn


def dataset_problems(method: Method, datasets: dict[str, Any], tokenizer: Any) -> list[str]:
    """The method's own check of each tokenized dataset, as the trainer makes it after
    ``adapt_rows`` (missing columns; for the online methods, reward functions that the rollout's
    keyword call would not fit): ``grimoire validate`` reports these before any weights load."""
    split = {"dataset": "train", "eval_dataset": "eval"}
    return [
        p
        for where, ds in datasets.items()
        for p in method.validate_dataset(method.adapt_rows(ds, tokenizer), split[where])
    ]


def missing_reference(
    method: Method, raw: Mapping[str, Any], config: TrainingConfig, datasets: dict[str, Any]
) -> list[str]:
    """The loss needs a reference model and the config gives it none (checked from the config,
    before any weights are loaded; the trainer checks the same again at set-up)."""
    if not method.needs_reference_model:
        return []
    if method.holds_reference:
        return []  # the method holds its own (distillation's teacher, loaded with the loss)
    loss_cfg = raw.get("loss") or {}
    if loss_cfg.get("ref_model") or loss_cfg.get("cache_reference") or raw.get("peft"):
        return []
    if config.precompute_ref_log_probs:
        return []
    cached = method.reference.cache_columns if method.reference is not None else ()
    if cached and all(set(cached) <= set(columns_of(ds)) for ds in datasets.values()):
        return []  # pre-tokenized rows that carry the reference log-probs
    precompute = (
        ", or training.precompute_ref_log_probs: true (the starting model scores the data once "
        "before training, then is released)"
        if cached
        else ""
    )
    return [
        f"loss.ref_model: {loss_cfg.get('type', 'the loss')!r} ({method.method_name}) needs a "
        "reference model and the config gives none: set loss.ref_model: copy (a frozen copy of "
        "the starting model: twice its memory) or loss.ref_model: <a path or hub name>, or add "
        f"a peft: section (LoRA: the base with adapters disabled is the reference){precompute}"
    ]


def build_run(raw: Mapping[str, Any]) -> Run:
    """:func:`check_run`, then load the reference (if any) and the model into a trainer.

    Data is loaded and tokenized before the model so bad rows fail fast and cheaply.
    """
    checked = check_run(raw)
    raw, config, datasets = checked.raw, checked.config, checked.datasets
    model_cfg, quantization = raw["model"], raw.get("quantization")
    model_path, tokenizer, callbacks = checked.model_path, checked.tokenizer, checked.callbacks
    loss_cls, loss_fn = checked.loss_cls, checked.loss_fn
    loss_cfg = raw.get("loss") or {"type": "sft"}
    model_kind = loss_cls.model_kind if issubclass(loss_cls, GrimoireLoss) else "causal_lm"
    ref_spec, cache = loss_cfg.get("ref_model"), loss_cfg.get("cache_reference")
    ref_path = ref_spec if ref_spec != REF_MODEL_COPY else None
    ref_model = None
    if ref_path or cache:
        # Default reference for caching: the starting policy itself (the usual DPO reference,
        # and what "copy" means).
        where = "loss.ref_model" if ref_spec and ref_spec != REF_MODEL_COPY else "model.pretrained"
        ref_path = _materialize_model(ref_path or model_path, config.output_dir, where=where)
        with phase(f"loading the reference model {ref_path}"):
            ref_model = load_model(model_cfg, ref_path, model_kind, quantization, where=where)
    if ref_model is not None and not cache:
        loss_fn = make_loss(
            loss_cls, loss_cfg["type"], {**checked.loss_args, "ref_model": ref_model}
        )
    if cache:
        method = as_method(loss_fn)
        datasets = {
            k: cache_reference(ref_model, v, method, config, k) for k, v in datasets.items()
        }
        del ref_model

    with phase(f"loading the model {model_path}"):
        model = load_model(model_cfg, model_path, model_kind, quantization)
    peft_config = build_peft(raw.get("peft"))
    _export_wandb_env(raw.get("wandb") or {})

    # Preparing the model and data (and precompute_ref_log_probs' reference pass) happens here.
    with phase("setting up the trainer"):
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


def tokenize(
    source: LoadedSource,
    raw: Mapping[str, Any],
    where: str,
    tokenizer: Any,
    max_length: int,
    truncate: bool = False,
):
    """Tokenize a read source with its ``tokenize`` section (default: the loss's tokenizer).

    The source's unreadable lines are reported with the rows' own problems, in one error.
    ``truncate`` (``training.truncate_long_samples``) makes the tokenizer's default
    ``truncation`` ``"cut"``: over-long rows are cut, counted and logged instead of reported.
    """
    tok = dict(tokenize_section(raw, where) or {})
    loss_type = (raw.get("loss") or {"type": "sft"})["type"]
    name = tok.pop("type", loss_type)
    fn = registry.resolve(name, registry.TOKENIZERS, f"{where}.tokenize.type")
    if fn is tokenize_grpo and is_peer_prompt_dataset(columns_of(source.dataset)):
        # Prompt rows grimoire-rl's tokenize_grpo already wrote (input_ids / attention_mask):
        # the online methods read them as they are (OnlineMethod.adapt_rows).
        return source.dataset
    tok.setdefault("max_length", max_length)
    if truncate:
        tok.setdefault("truncation", "cut")
    kwargs = {"tokenizer": tokenizer, **tok}
    if getattr(fn, "dataset_level", False):  # e.g. pretrain blocks: rows are regrouped
        if source.problems:
            raise DataError(listed(source.problems), title=f"invalid data in {where}")
        return fn(list(source.dataset), **_accepted(fn, kwargs))
    return tokenize_dataset(
        source.dataset,
        fn,
        source_name=where,
        locations=source.locations,
        problems=source.problems,
        **_accepted(fn, kwargs),
    )


def _accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop the CLI-supplied ``tokenizer``/``max_length`` when ``fn`` does not take them.

    A pre-tokenized loader, say, needs no tokenizer; user-given kwargs were already checked
    against the signature during validation.
    """
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


def _materialize_model(
    name_or_path: str,
    output_dir: str,
    gguf_file: str | None = None,
    where: str = "model.pretrained",
) -> str:
    """``tiny:<arch>`` -> build the tiny model into ``<output_dir>/tiny-model``; a GGUF file
    (``*.gguf``, ``grimoire://models/<name>``, or a folder + ``gguf_file``) -> its cached
    transformers folder (converted on first use); ``grimoire://REL`` -> the folder inside the
    package (a bundled model); else as given."""
    gguf = is_gguf_name(name_or_path, gguf_file)
    if name_or_path.startswith(PACKAGE_PREFIX) and not gguf:
        return str(resolve_path(name_or_path))
    if not gguf and not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    # A tiny model is saved and reloaded (not used in memory) so the run exercises the real
    # from_pretrained path. Under a multi-process launch one process per node writes it (or
    # converts the GGUF file) while the others wait, then find the finished folder.
    # cpu= must match the trainer's Accelerator: PartialState is a process-wide singleton and
    # the first one decides; cpu=False on a CPU-only machine would lock every worker into a
    # separate 1-process run instead of one gloo group.
    state = PartialState(cpu=not has_accelerator())
    with state.local_main_process_first():
        if gguf:
            return str(materialize_gguf(name_or_path, gguf_file, where))
        path = Path(output_dir) / "tiny-model"
        if state.is_local_main_process:
            save_tiny(path, arch=name_or_path[len(TINY_PREFIX) :])
    return str(path)


def cache_reference(
    ref_model: Any, dataset: Any, method: Method, config: TrainingConfig, where: str = "dataset"
) -> Any:
    """Precompute reference log-probs into ``dataset`` (the config's ``where`` section) once
    (``loss.cache_reference: true``)."""
    return cache_reference_log_probs(
        ref_model,
        dataset,
        batch_size=config.effective_eval_batch_size,
        fused=method.fused,
        reduction=method.logp_reduction,
        autocast_dtype=torch.bfloat16 if decide(config.mixed_precision)[0] == "bf16" else None,
        max_length=config.max_length,
        # One pass over every row with the reference: minutes on a real model, said as it goes.
        progress=lambda _, rows: phase(f"cache_reference: reference log-probs of {where}", rows),
    )


def build_peft(section: Mapping[str, Any] | None):
    """A peft ``LoraConfig`` from the ``peft:`` section: ``type: lora`` (the default, and the only
    type) plus ``LoraConfig``'s fields; ``task_type`` defaults to CAUSAL_LM."""
    if not section:
        return None
    from peft import LoraConfig

    kwargs = {k: v for k, v in section.items() if k != "type"}  # (types checked up front)
    return LoraConfig(**{"task_type": "CAUSAL_LM", **kwargs})


def _export_wandb_env(section: Mapping[str, Any]) -> None:
    # wandb reads WANDB_PROJECT / WANDB_ENTITY itself; an explicit environment wins.
    for key, env in (("project", "WANDB_PROJECT"), ("entity", "WANDB_ENTITY")):
        if section.get(key):
            os.environ.setdefault(env, str(section[key]))


# --------------------------------------------------------------------------- summary
