"""Which engine samples an online method's rollouts: an engine object, a name, or a mapping.

Stage: rollout (see docs/architecture.md). The methods' ``engine`` argument (YAML:
``loss.args.engine``) is one of

- an engine object (``engine=VLLMEngine(...)``): used as it is, its own sampling settings hold;
- a name, ``"hf"`` (the default: ``model.generate`` on the training model), ``"vllm"`` (a
  colocated vLLM) or ``"vllm-server"`` (a ``grimoire vllm-serve`` process; its ``url`` in
  ``args``);
- a mapping ``{type: vllm, args: {...}}``: the engine's own settings (``gpu_memory_utilization``,
  ``max_model_len``, ...).

With a name or a mapping the method's sampling arguments (``temperature``, ``top_p``,
``top_k``, ``max_new_tokens``, ``generation_batch_size``) are passed to the engine, so they are
set in one place; giving one of them again under ``args`` is an error.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from grimoire.config.registry import ENGINES, import_spec
from grimoire.errors import ConfigError, did_you_mean
from grimoire.rollout.engines.base import RolloutEngine
from grimoire.rollout.engines.sampler import SamplerConfig
from grimoire.rollout.engines.sampler_process import ASYNC_SAMPLERS
from grimoire.rollout.engines.vllm_common import LORA_SYNCS
from grimoire.rollout.engines.vllm_engine import require_vllm

#: The method's arguments every engine receives (not to be repeated in a mapping's ``args``).
SAMPLING_ARGS = ("max_new_tokens", "temperature", "top_p", "top_k", "generation_batch_size")
#: What ``engine`` may be.
EngineSpec = RolloutEngine | str | Mapping[str, Any] | None


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class of a short name of :data:`~grimoire.config.registry.ENGINES`."""
    return import_spec(ENGINES[name])


def engine_problems(spec: Any, where: str = "engine") -> list[str]:
    """Every problem of an ``engine`` value, without building it (the YAML check): an unknown
    name, unknown or repeated arguments, or ``vllm`` without the package."""
    if spec is None or isinstance(spec, RolloutEngine):
        return []
    if isinstance(spec, str):
        name, args = spec, {}
    elif isinstance(spec, Mapping):
        extra = sorted(set(spec) - {"type", "args"})
        if extra or not isinstance(spec.get("type"), str):
            return [f"{where}: expected a name or {{type: <name>, args: {{...}}}}, got {spec!r}"]
        name, args = spec["type"], spec.get("args") or {}
        if not isinstance(args, Mapping):
            return [f"{where}.args: expected a mapping, got {args!r}"]
    else:
        return [
            f"{where}: expected an engine name ({', '.join(ENGINES)}) or a mapping, got {spec!r}"
        ]
    if name not in ENGINES:
        return [
            f"{where}: unknown engine {name!r}{did_you_mean(name, ENGINES)}; known: {', '.join(ENGINES)}"
        ]
    params = inspect.signature(engine_class(name).__init__).parameters
    problems = [
        f"{where}.args.{k}: a sampling setting; give it as the method's own argument (loss.args.{k})"
        for k in args
        if k in SAMPLING_ARGS
    ]
    known = [p for p in params if p not in ("self", *SAMPLING_ARGS)]
    problems += [
        f"{where}.args.{k}: unknown {name} engine argument{did_you_mean(k, known)}; known: {', '.join(known)}"
        for k in args
        if k not in params
    ]
    if "lora_sync" in args and "lora_sync" in params and args["lora_sync"] not in LORA_SYNCS:
        choices = " or ".join(repr(m) for m in LORA_SYNCS)
        problems.append(f"{where}.args.lora_sync: {args['lora_sync']!r}; expected {choices}")
    sampler = args.get("async_sampler", ASYNC_SAMPLERS[0])
    if "async_sampler" in params and sampler not in ASYNC_SAMPLERS:
        choices = " or ".join(repr(m) for m in ASYNC_SAMPLERS)
        problems.append(f"{where}.args.async_sampler: {sampler!r}; expected {choices}")
    if name == "vllm":
        try:
            require_vllm(where)
        except ConfigError as exc:
            problems += exc.problems
    return problems


def build_engine(spec: EngineSpec, sampling: SamplerConfig) -> RolloutEngine:
    """The engine ``spec`` names (module docstring), with the method's ``sampling`` settings
    (an engine object keeps its own)."""
    if isinstance(spec, RolloutEngine):
        return spec
    problems = engine_problems(spec)
    if problems:
        raise ConfigError(problems)
    spec = spec or "hf"
    name = spec if isinstance(spec, str) else spec["type"]
    args = {} if isinstance(spec, str) else dict(spec.get("args") or {})
    settings = {k: getattr(sampling, k) for k in SAMPLING_ARGS}
    return engine_class(name)(**settings, **args)


__all__ = ["SAMPLING_ARGS", "EngineSpec", "build_engine", "engine_class", "engine_problems"]
