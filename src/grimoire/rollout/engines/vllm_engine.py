"""The vLLM backend: a colocated vLLM ``LLM`` samples; the training model scores and trains.

Stage: rollout (see docs/architecture.md). :class:`VLLMEngine` implements
:meth:`~grimoire.rollout.engines.base.RolloutEngine._sample` and ``sync_weights``; the base class pads
the completions, cuts them at EOS and scores the old log-probs with the training policy, as for
every backend.

How it is put together, and why:

- **Colocated, in process.** Each rank builds its own offline ``vllm.LLM`` in the training
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), over its own prompts: no server, and the
  weight sync hands vLLM the training tensors themselves (no copy through a socket). With
  several ranks the engine joins the trainer's process group (vLLM's ``external_launcher``),
  so ``tensor_parallel_size`` ranks in a row can share one engine.
- **No checkpoint on disk.** vLLM is started from the policy's ``config.json`` alone with dummy
  weights (``load_format="dummy"``, no tokenizer: prompts and completions are token ids), and
  the policy's weights are loaded into it before the first rollout (:meth:`sync_weights`).
- **Weight sync** whenever the weights changed: after an optimizer step, or any in-place write
  such as a checkpoint load (:func:`~grimoire.rollout.engines.vllm_weights.weights_version`);
  before sampling, changed weights are streamed one parameter at a time into vLLM's
  ``reload_weights`` (LoRA merged, FSDP2 shards gathered one tensor at a time:
  :func:`~grimoire.rollout.engines.vllm_weights.policy_weights`), and vLLM's prefix cache, computed
  with the old weights, is dropped. A LoRA policy with ``lora_sync: adapter`` (the default)
  starts vLLM with LoRA on, loads the base weights once, and then hands vLLM only the adapter,
  saved as ``save_pretrained`` does, as a new ``LoRARequest`` per weight version.
- **Sampling parameters one to one**: temperature, top_p, top_k (0 = off), max_new_tokens,
  ``n = G``, EOS (exactly the tokenizer's EOS ids: the checkpoint's generation config is not
  read, so no default top-k or repetition penalty sneaks in), and a seed per request derived
  from (seed, weight version, prompt), so a prompt's samples do not depend on which rank or
  batch it landed in.
- **Sampler log-probs**: vLLM reports the log-prob of each token it drew, after temperature and
  top-k/top-p (``logprobs_mode="processed_logprobs"``, as TRL). They ride in the rollout as
  ``sampler_logps``; the policy-gradient losses weight each token by the truncated importance
  ratio ``min(pi_old / pi_vllm, cap)`` (:attr:`importance_sampling_cap`).
- **Memory**: on GPUs ``gpu_memory_utilization`` is vLLM's share of the device, and
  ``sleep_mode`` (default on with CUDA) releases vLLM's weights and KV cache between rollouts
  (level 2: the weights are pushed again on waking). On CPU the KV cache is sized from
  ``max_num_seqs x max_model_len`` (at most 4 GiB) unless ``kv_cache_memory_bytes`` is given.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grimoire.errors import ConfigError
from grimoire.rollout.engines.vllm_common import (
    INSTALL_HINT,
    VLLMSamplerEngine,
    completions,
    llm_args,
    lora_args,
    plain_model,
    require_vllm,
    vllm_available,
)
from grimoire.rollout.engines.vllm_weights import lora_rank


class VLLMEngine(VLLMSamplerEngine):
    """Samples with a colocated vLLM ``LLM``; see the module docstring for the design.

    Args (besides the sampler settings every engine takes, and ``seed``,
    ``importance_sampling``, ``importance_sampling_cap``:
    :class:`~grimoire.rollout.engines.vllm_common.VLLMSamplerEngine`):
        gpu_memory_utilization: vLLM's share of the GPU's memory (weights + KV cache).
        max_model_len: longest prompt + completion; default: the run's ``max_length``, capped
            by the model's ``max_position_embeddings``.
        tensor_parallel_size: ranks that share one engine (consecutive ranks; must divide the
            world size). Each rank of a group still trains on its own prompts.
        sleep_mode: release vLLM's memory between rollouts (GPU only); default: on with CUDA.
        dtype: vLLM's weights; ``"auto"``: the policy's parameter dtype.
        enforce_eager: no CUDA graphs / compilation; default: on for CPU, off for CUDA.
        kv_cache_memory_bytes, max_num_seqs: vLLM's own settings (None: the defaults above).
        llm_kwargs: any other ``vllm.LLM`` argument.
    """

    def __init__(
        self,
        *,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        sleep_mode: bool | None = None,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        **settings: Any,
    ):
        super().__init__(**settings)
        problems = []
        if not 0.0 < gpu_memory_utilization <= 1.0:
            problems.append(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size}")
        if problems:
            raise ValueError("VLLMEngine: " + "; ".join(problems))
        require_vllm("VLLMEngine")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.tensor_parallel_size = tensor_parallel_size
        self.sleep_mode = torch.cuda.is_available() if sleep_mode is None else sleep_mode
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.max_num_seqs = max_num_seqs
        self.llm_kwargs = dict(llm_kwargs or {})
        self.llm: Any = None
        self._tp_group: Any = None
        self._folder: Any = None
        self._owns_group = True
        self._lora_request: Any = None

    # ------------------------------------------------------------------ set-up

    def _connect(self) -> None:
        """Start vLLM for the bound model (once) and check it can run it."""
        if self.llm is not None:
            return
        config = plain_model(self.policy).config
        kwargs = self._llm_args(config)
        try:
            with _process_state_kept(), _odd_attributes_set_aside():
                from vllm import LLM  # pyright: ignore[reportMissingImports]

                self.llm = LLM(**kwargs)
            # Dummy weights are enough to find an unsupported architecture, head size or dtype
            # now rather than at the first rollout.
            self.llm.generate(
                [{"prompt_token_ids": [self.pad_token_id]}],
                self._params(self.request_args([self.pad_token_id], 1, True)),
                use_tqdm=False,
            )
        except Exception as exc:
            self.close()
            arch = (config.architectures or [type(plain_model(self.policy)).__name__])[0]
            raise ConfigError(
                [
                    f"engine: vllm cannot run this model ({arch}, {config.model_type}): "
                    f"{type(exc).__name__}: {exc}"
                ],
                title="vLLM could not start (nothing was trained)",
            ) from exc
        self._sleep(self.llm)

    def _llm_args(self, config: Any) -> dict[str, Any]:
        """``vllm.LLM`` arguments: the policy's config in a temporary folder, dummy weights."""
        self._folder = tempfile.TemporaryDirectory(prefix="grimoire-vllm-")
        config = config.__class__.from_dict(config.to_dict())  # a copy: the policy's is not ours
        if not getattr(config, "architectures", None):
            config.architectures = [type(plain_model(self.policy)).__name__.removeprefix("FSDP")]
        config.save_pretrained(self._folder.name)
        limits = [
            x for x in (self.max_length, getattr(config, "max_position_embeddings", None)) if x
        ]
        max_model_len = self.max_model_len or (min(limits) if limits else None)
        dtype = self.dtype
        if dtype == "auto":
            dtype = str(next(self.policy.parameters()).dtype).removeprefix("torch.")
        kwargs = llm_args(
            config,
            model=self._folder.name,
            dtype=dtype,
            seed=self.seed,
            max_model_len=max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            sleep_mode=self.sleep_mode,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_num_seqs=self.max_num_seqs,
        )
        kwargs["load_format"] = "dummy"
        if self.adapter_sync:
            kwargs.update(lora_args(lora_rank(self.policy)))
        # In process, so the weight sync can hand vLLM the training tensors themselves.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Without a process group vLLM starts a 1-rank one of its own, and closes it on close().
        self._owns_group = not (dist.is_available() and dist.is_initialized())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            self._tp_group = _tensor_parallel_group(self.tensor_parallel_size)
        elif self.tensor_parallel_size > 1:
            raise ConfigError(
                [
                    f"engine: vllm: tensor_parallel_size={self.tensor_parallel_size} needs as many "
                    "training processes (the engine is colocated: one rank per shard)"
                ]
            )
        return {**kwargs, **self.llm_kwargs}

    def close(self) -> None:
        """Shut vLLM down. Its shutdown also destroys torch's default process group; when that
        group is the trainer's (several ranks), only vLLM's own groups are destroyed."""
        if self.llm is None:
            return
        from vllm.distributed import parallel_state as state  # pyright: ignore[reportMissingImports]

        destroy_world = state.destroy_distributed_environment

        def own_groups_only() -> None:
            if state._WORLD is not None:  # vLLM's groups over the trainer's ranks
                state._WORLD.destroy()
            state._WORLD = None

        if not self._owns_group:
            state.destroy_distributed_environment = own_groups_only
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            state.destroy_distributed_environment = destroy_world
            self.llm = None
            self._vllm.holds = None
            self._lora_request = None
            if self._folder is not None:
                self._folder.cleanup()
            if self._adapters is not None:  # the adapters saved for vLLM
                self._adapters.cleanup()
                self._adapters = None

    # ------------------------------------------------------------------ weights

    def _push_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load weights into vLLM (streamed, one tensor at a time)."""
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self._drop_adapter()  # full weights are the whole policy (an adapter push may follow)

    def _push_adapter(self, adapter_id: int, folder: Path) -> None:
        """Register the adapter saved in ``folder`` (vLLM loads it from there) and drop the one
        before it (one adapter slot, ``max_loras=1``)."""
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        self._drop_adapter()
        self._lora_request = LoRARequest(f"policy-{adapter_id}", adapter_id, str(folder))
        self.llm.llm_engine.add_lora(self._lora_request)
        self.llm.reset_prefix_cache()

    def _drop_adapter(self) -> None:
        if self._lora_request is not None:
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
            self._lora_request = None

    # ------------------------------------------------------------------ sampling

    def _draw(
        self, prompts: list[list[int]], n: int, greedy: bool, with_logps: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        mine, offset = len(prompts), 0
        if self._tp_group is not None:  # a tensor-parallel group samples every member's prompts
            shares: list[Any] = [None] * dist.get_world_size(self._tp_group)
            dist.all_gather_object(shares, prompts, group=self._tp_group)
            offset = sum(len(s) for s in shares[: dist.get_rank(self._tp_group)])
            prompts = [p for share in shares for p in share]
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        params = [self._params(self.request_args(p, n, greedy)) for p in prompts]
        outputs = self.llm.generate(
            requests, params, use_tqdm=False, lora_request=self._lora_request
        )
        if self._tp_group is not None:
            outputs = outputs[offset : offset + mine]
        self._sleep(self.llm)
        return completions(outputs, with_logps=with_logps)

    @staticmethod
    def _params(args: dict[str, Any]) -> Any:
        from vllm import SamplingParams  # pyright: ignore[reportMissingImports]

        return SamplingParams(**args)

    def _sleep(self, llm: Any) -> None:
        if self.sleep_mode:
            llm.sleep(level=2)  # frees the weights too: push them again on waking
            self._vllm.holds = None
            self._base_loaded = False


def _tensor_parallel_group(size: int) -> Any:
    """This rank's group of ``size`` consecutive ranks (None for 1), set up the way vLLM's
    ``external_launcher`` reads it: from torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ConfigError(
            [f"engine: vllm: tensor_parallel_size={size} must divide the world size {world}"]
        )
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if size == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(i, i + size)) for i in range(0, world, size)]
    )
    return group


@contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what an in-process vLLM start does to the training process: it reseeds the global
    RNGs and, on CPU, pins torch to one thread and disables ``torch.set_num_threads``."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    py_state = random.getstate()
    np_random: Any = None
    try:
        import numpy as np

        np_random = np.random.get_state()
    except ImportError:
        np = None  # type: ignore[assignment]
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        try:
            yield
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_random)


@contextmanager
def _odd_attributes_set_aside() -> Iterator[None]:
    """Module attributes whose ``__dict__`` is not a mapping, set aside while vLLM starts.

    vLLM's CPU build (no Triton) scans every imported module's attributes at start, to rebind
    its kernels, and reads ``vars(value).get(...)`` on each; llvmlite's ``ffi.lib`` (numba's,
    which the batch planner imports) answers any attribute, ``__dict__`` included, with a
    function wrapper, and that scan then fails. Nothing of theirs runs during the start.
    """
    aside = []
    if not torch.cuda.is_available():
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for name, value in list(namespace.items()):
                try:
                    odd = not hasattr(getattr(value, "__dict__", {}), "get")
                except Exception:  # an attribute that raises on access: vLLM skips it too
                    continue
                if odd:
                    aside.append((namespace, name, namespace.pop(name)))
    try:
        yield
    finally:
        for namespace, name, value in aside:
            namespace[name] = value


__all__ = ["INSTALL_HINT", "VLLMEngine", "llm_args", "require_vllm", "vllm_available"]
