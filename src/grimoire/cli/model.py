"""The ``model:`` and ``quantization:`` sections of the YAML schema: validation, the spellings of
earlier releases, and the ``from_pretrained`` calls they become.

The schema is grimoire-rl's (its README documents it, so a grimoire-rl config runs unchanged)::

    model:
      pretrained: Qwen/Qwen2.5-0.5B          # hub name, local folder, a .gguf file,
                                             # grimoire://models/<name>, or tiny:llama|qwen2|gemma2
      gguf_file: null                        # a .gguf file inside the pretrained folder
      tokenizer: null                        # default: the model's own
      model_kwargs:                          # -> AutoModelFor*.from_pretrained(**model_kwargs)
        dtype: bfloat16                      # (torch_dtype is accepted: transformers' old name)
        attn_implementation: sdpa
      tokenizer_kwargs: {}                   # -> AutoTokenizer.from_pretrained(**tokenizer_kwargs)
    quantization:                            # -> transformers.BitsAndBytesConfig(**quantization)
      load_in_4bit: true
      bnb_4bit_compute_dtype: bfloat16

Grimoire's own earlier spellings (``model.name_or_path``, ``model.dtype``,
``model.attn_implementation``, ``model.trust_remote_code``, ``model.quantization``) still work for
one release: :func:`canonical_model` moves them to their new place with a
:class:`~grimoire.errors.GrimoireDeprecationWarning` (a ``FutureWarning``).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

from grimoire.cli.sections import section_problems
from grimoire.config.training import check_type
from grimoire.errors import ConfigError, GrimoireDeprecationWarning, did_you_mean
from grimoire.model.gguf import resolve_pretrained

MODEL_KEYS: dict[str, Any] = {
    "pretrained": str,
    "tokenizer": str | None,
    # A .gguf file inside the folder that model.pretrained names (transformers' spelling).
    "gguf_file": str | None,
    "model_kwargs": dict | None,
    "tokenizer_kwargs": dict | None,
}
#: Earlier spellings -> where they live now (a dotted path from the top of the config).
LEGACY_MODEL_KEYS: dict[str, tuple[str, ...]] = {
    "name_or_path": ("model.pretrained",),
    "dtype": ("model.model_kwargs.dtype",),
    "attn_implementation": ("model.model_kwargs.attn_implementation",),
    # Both loaders run the repository's code when this is on, so it moves to both.
    "trust_remote_code": (
        "model.model_kwargs.trust_remote_code",
        "model.tokenizer_kwargs.trust_remote_code",
    ),
    "quantization": ("quantization",),
}
#: dtype spellings accepted in model_kwargs / quantization (grimoire-rl's aliases included).
DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
#: model_kwargs that grimoire sets itself or that would break the training set-up.
RESERVED_MODEL_KWARGS = {
    "quantization_config": "give a top-level quantization: section (it becomes the "
    "BitsAndBytesConfig)",
    "device_map": "grimoire/accelerate place the model on each process's device; a device_map "
    "would split it across devices instead (not supported for training)",
    "num_labels": "set by the loss (reward modelling uses 1)",
    "gguf_file": "write model.gguf_file (grimoire converts the file once and caches it)",
}
TINY_PREFIX = "tiny:"
PRETRAINED_KINDS = (
    "a hub name, a local folder, a .gguf file, grimoire://models/<name>, or tiny:llama"
)
#: ``loss.ref_model`` value that asks the loss for a frozen copy of the starting policy: passed
#: through as the string ``ref_model="copy"`` instead of loading a model from that path.
REF_MODEL_COPY = "copy"
TINY_ARCHS = ("llama", "qwen2", "gemma2")


def canonical_model(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``raw`` with earlier spellings moved to their new place, and the problems found.

    Each move emits a :class:`GrimoireDeprecationWarning` (a ``FutureWarning``) naming the new key
    (the ``grimoire`` command prints it as one line, once). Giving both spellings of one setting
    is a problem (which would win is not obvious), reported with the others by the validator.
    """
    out = dict(raw)
    model = raw.get("model")
    if not isinstance(model, Mapping) or not any(k in model for k in LEGACY_MODEL_KEYS):
        return out, []
    out = copy.deepcopy(out)
    model = out["model"] = dict(out["model"])
    problems: list[str] = []
    for old, targets in LEGACY_MODEL_KEYS.items():
        if old not in model:
            continue
        value = model.pop(old)
        for i, target in enumerate(targets):
            *parents, leaf = target.split(".")
            node = out
            for part in parents:  # (a deep copy: the nested dicts are ours to change)
                if not isinstance(node.get(part), dict):
                    node[part] = dict(node[part]) if isinstance(node.get(part), Mapping) else {}
                node = node[part]
            if leaf not in node:
                node[leaf] = value
            elif i == 0:  # a second target already set (tokenizer_kwargs) is simply kept
                problems.append(f"model.{old} and {target} are both given: keep only {target}")
        warnings.warn(
            f"model.{old} is deprecated (grimoire-rl's schema is canonical): write "
            f"{' and '.join(targets)} instead; the old spelling goes away in the next release",
            GrimoireDeprecationWarning,
            stacklevel=3,
        )
    return out, problems


def model_problems(model: Any, quantization: Any) -> list[str]:
    """Every problem of the (canonical) ``model:`` and ``quantization:`` sections."""
    if model is None:
        return [f"model.pretrained: required ({PRETRAINED_KINDS})"]
    p = section_problems(model, "model", MODEL_KEYS, accepted=LEGACY_MODEL_KEYS)
    if p or not isinstance(model, Mapping):
        return p
    name = model.get("pretrained")
    if not name:
        p.append(f"model.pretrained: required ({PRETRAINED_KINDS})")
    elif name.startswith(TINY_PREFIX) and name[len(TINY_PREFIX) :] not in TINY_ARCHS:
        arch = name[len(TINY_PREFIX) :]
        p.append(
            f"model.pretrained: unknown tiny architecture {arch!r}{did_you_mean(arch, TINY_ARCHS)};"
            f" known: {', '.join(TINY_PREFIX + a for a in TINY_ARCHS)}"
        )
    kwargs = model.get("model_kwargs") or {}
    if "dtype" in kwargs and "torch_dtype" in kwargs:
        p.append("model.model_kwargs: give dtype or torch_dtype (its old name), not both")
    for key in ("dtype", "torch_dtype"):
        if key in kwargs:
            p += _dtype_problems(kwargs[key], f"model.model_kwargs.{key}")
    for key, why in RESERVED_MODEL_KWARGS.items():
        if key in kwargs:
            p.append(f"model.model_kwargs.{key}: not accepted: {why}")
    for where, section in (
        ("model_kwargs", kwargs),
        ("tokenizer_kwargs", model.get("tokenizer_kwargs") or {}),
    ):
        if "trust_remote_code" in section and not isinstance(section["trust_remote_code"], bool):
            p.append(f"model.{where}.trust_remote_code: must be true or false")
    if "attn_implementation" in kwargs and (
        msg := check_type(
            "model.model_kwargs.attn_implementation", kwargs["attn_implementation"], str | None
        )
    ):
        p.append(msg)
    return p + quantization_problems(quantization)


def quantization_problems(quant: Any) -> list[str]:
    """Unknown fields (checked against ``BitsAndBytesConfig``), dtypes, and bitsandbytes itself."""
    if quant is None:
        return []
    if not isinstance(quant, Mapping):
        return [f"quantization: expected a mapping of BitsAndBytesConfig fields, got {quant!r}"]
    from transformers import BitsAndBytesConfig

    fields = [
        n
        for n in inspect.signature(BitsAndBytesConfig.__init__).parameters
        if n not in ("self", "kwargs")
    ]
    p = [
        f"quantization.{k}: unknown key{did_you_mean(str(k), fields)}; valid keys: "
        + ", ".join(fields)
        for k in quant
        if k not in fields
    ]
    if quant.get("load_in_4bit") and quant.get("load_in_8bit"):
        p.append("quantization: load_in_4bit and load_in_8bit are exclusive")
    for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        if key in quant:
            p += _dtype_problems(quant[key], f"quantization.{key}", allow_auto=False)
    if quant.get("bnb_4bit_quant_type", "nf4") not in ("nf4", "fp4"):
        p.append("quantization.bnb_4bit_quant_type: must be 'nf4' or 'fp4'")
    if importlib.util.find_spec("bitsandbytes") is None:
        p.append(
            "quantization: needs bitsandbytes, which is not installed "
            "(pip install 'grimoire[quantization]'; it also needs a CUDA GPU)"
        )
    return p


def _dtype_problems(value: Any, where: str, allow_auto: bool = True) -> list[str]:
    allowed = [k for k in DTYPE_ALIASES if allow_auto or k != "auto"]
    if isinstance(value, str) and value in allowed:
        return []
    hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
    return [f"{where}: {value!r} is not one of {allowed}{hint}"]


def torch_dtype(name: str) -> Any:
    """``"bf16"`` -> ``torch.bfloat16``; ``"auto"`` stays ``"auto"`` (the checkpoint's dtype)."""
    import torch

    canonical = DTYPE_ALIASES[name]
    return canonical if canonical == "auto" else getattr(torch, canonical)


def from_pretrained_kwargs(model_cfg: Mapping[str, Any], quantization: Any = None) -> dict:
    """``model.model_kwargs`` as ``from_pretrained`` arguments (dtype names -> torch dtypes).

    ``trust_remote_code`` is off unless the config turns it on: a hub repository's own code only
    runs when asked for. ``dtype`` defaults to ``auto`` (the checkpoint's dtype).
    """
    kwargs = dict(model_cfg.get("model_kwargs") or {})
    if "torch_dtype" in kwargs:  # transformers 5 renamed it
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    kwargs["dtype"] = torch_dtype(kwargs.get("dtype", "auto"))
    kwargs.setdefault("trust_remote_code", False)
    if quantization:
        kwargs["quantization_config"] = build_quantization(quantization)
    return kwargs


def build_quantization(quant: Mapping[str, Any]):
    """A ``BitsAndBytesConfig``; a clear error naming the extra when bitsandbytes is missing."""
    from transformers import BitsAndBytesConfig

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(["quantization needs bitsandbytes: pip install 'grimoire[quantization]'"])
    kwargs = dict(quant)
    for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        if key in kwargs:
            kwargs[key] = torch_dtype(kwargs[key])
    if kwargs.get("load_in_4bit") and "bnb_4bit_compute_dtype" not in kwargs:
        kwargs["bnb_4bit_compute_dtype"] = torch_dtype("bfloat16")
    return BitsAndBytesConfig(**kwargs)


def load_tokenizer(model_cfg: Mapping[str, Any], model_path: str):
    """``AutoTokenizer`` from ``model.tokenizer`` (default: the model's own) + tokenizer_kwargs."""
    from transformers import AutoTokenizer

    kwargs = {"trust_remote_code": False, **(model_cfg.get("tokenizer_kwargs") or {})}
    name, where = (
        (resolve_pretrained(model_cfg["tokenizer"], where="model.tokenizer"), "model.tokenizer")
        if model_cfg.get("tokenizer")
        else (model_path, "model.pretrained")
    )
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        # Validation checked that the folder or hub name exists; what is left is its contents
        # (no tokenizer files, an unknown model type, an unreachable hub): name the key.
        raise ConfigError([f"{where}: cannot load a tokenizer from {name!r}: {exc}"]) from exc


def load_model(
    model_cfg: Mapping[str, Any],
    model_path: str,
    kind: str = "causal_lm",
    quantization: Mapping[str, Any] | None = None,
    where: str = "model.pretrained",
):
    """``from_pretrained`` with ``model_kwargs`` and the ``quantization`` section.

    ``kind`` comes from the loss class (``model_kind``): ``"causal_lm"``, or
    ``"sequence_classification"`` (a one-score head, for reward modelling). ``where`` is the
    config key named when loading fails.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = from_pretrained_kwargs(model_cfg, quantization)
    try:
        if kind == "sequence_classification":
            return AutoModelForSequenceClassification.from_pretrained(
                model_path, num_labels=1, **kwargs
            )
        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except TypeError as exc:  # an unknown model_kwargs key surfaces here, from the model class
        raise ConfigError([f"model.model_kwargs: {exc}"]) from exc
    except (OSError, ValueError) as exc:  # the folder's contents, or the hub (see load_tokenizer)
        raise ConfigError([f"{where}: cannot load a model from {model_path!r}: {exc}"]) from exc


__all__ = [
    "DTYPE_ALIASES",
    "LEGACY_MODEL_KEYS",
    "MODEL_KEYS",
    "REF_MODEL_COPY",
    "TINY_ARCHS",
    "TINY_PREFIX",
    "build_quantization",
    "canonical_model",
    "from_pretrained_kwargs",
    "load_model",
    "load_tokenizer",
    "model_problems",
    "quantization_problems",
    "torch_dtype",
]
