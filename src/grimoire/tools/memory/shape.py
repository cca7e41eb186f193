"""The model ``estimate-memory`` sizes: read from a config alone, no weights loaded.

:func:`load_shape` reads a ``config.json`` (a file, a model folder, a hub name, or ``tiny:<arch>``
for the models :mod:`grimoire.model.tiny` builds) with ``AutoConfig``, so a 70B model is sized in
a second; the sizes themselves are read by :func:`grimoire.config.model_shape.shape_from_config`
(Llama-shaped decoders). Mixture-of-experts and other layouts are refused by name rather than
sized wrongly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from grimoire.config.model_shape import (
    LINEARS,
    PEFT_DEFAULT_TARGETS,
    LoraShape,
    ModelShape,
    experts_of,
    shape_from_config,
)
from grimoire.errors import ConfigError
from grimoire.model.tiny import build_tokenizer, tiny_config

TINY_PREFIX = "tiny:"


def lora_from_section(section: Any) -> LoraShape | None:
    """The ``peft:`` section of a run config (``LoraConfig`` fields) as a :class:`LoraShape`."""
    if not section:
        return None
    if not isinstance(section, dict):
        raise ConfigError([f"peft: expected a mapping of LoraConfig arguments, got {section!r}"])
    targets = section.get("target_modules") or PEFT_DEFAULT_TARGETS
    if isinstance(targets, str):
        # peft: "all-linear" is every Linear but the head; any other string is a regex that must
        # match a module's full name.
        if targets == "all-linear":
            chosen = LINEARS
        else:
            chosen = tuple(
                n for n in LINEARS if re.fullmatch(targets, f"model.layers.0.self_attn.{n}")
            ) or tuple(n for n in LINEARS if re.fullmatch(targets, f"model.layers.0.mlp.{n}"))
    else:
        chosen = tuple(n for n in LINEARS if any(str(t).endswith(n) for t in targets))
    if not chosen:
        raise ConfigError(
            [f"peft.target_modules: {targets!r} names none of the projections {list(LINEARS)}"]
        )
    return LoraShape(
        r=int(section.get("r", 8)),
        targets=chosen,
        dropout=float(section.get("lora_dropout", 0.0)),
        modules_to_save=tuple(section.get("modules_to_save") or ()),
    )


def dense_shape(config: Any, name: str = "model") -> ModelShape:
    """:func:`~grimoire.config.model_shape.shape_from_config`, refusing mixture-of-experts
    models (the estimate does not model routed experts)."""
    if experts_of(config) > 1:
        raise ConfigError(
            [f"{name}: mixture-of-experts models are not modelled by estimate-memory"]
        )
    return shape_from_config(config, name)


def load_shape(source: str | Path, trust_remote_code: bool = False) -> ModelShape:
    """The shape of ``source``: a ``config.json`` file, a model folder, a hub name (its config
    only, ``HF_HUB_OFFLINE`` respected) or ``tiny:<arch>``. ``trust_remote_code`` only when the
    run config asks for it."""
    source = str(source)
    if source.startswith(TINY_PREFIX):
        arch = source[len(TINY_PREFIX) :]
        # As the CLI builds it: the vocabulary of the character tokenizer, rounded up to 8.
        vocab = -(-len(build_tokenizer()) // 8) * 8
        try:
            return dense_shape(tiny_config(arch, vocab_size=vocab), source)
        except (KeyError, ValueError) as exc:
            raise ConfigError([f"{source}: unknown tiny architecture ({exc})"]) from exc
    path = Path(source)
    if path.is_file():
        try:
            return dense_shape(json.loads(path.read_text(encoding="utf-8")), path.stem)
        except json.JSONDecodeError as exc:
            raise ConfigError([f"{path}: not valid JSON ({exc})"]) from exc
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"cannot read the model config of {source!r}: {exc}"]) from exc
    return dense_shape(config, path.name or source)


__all__ = ["TINY_PREFIX", "dense_shape", "load_shape", "lora_from_section"]
