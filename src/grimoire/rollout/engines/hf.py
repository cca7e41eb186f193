"""The HF ``generate`` backend: samples from the training model itself, one prefill per prompt.

Stage: rollout (see docs/architecture.md). :class:`HFGenerateEngine` implements
:meth:`~grimoire.rollout.engines.base.RolloutEngine._sample`; the base class pads the completions and
scores the old log-probs.

One prefill per prompt: a group's ``n`` completions share their prompt, so the prompt's KV cache
is computed once for the unique prompts (``[P, L - 1]``: all but the last prompt token) and
repeated ``n`` times along the batch (``DynamicCache.batch_repeat_interleave``); ``generate``
then runs only the last prompt token and the decoding steps. The repeated cache holds the same
values the ``n``-times-repeated prefill would have computed, so the logits, and with one seed the
sampled tokens, are today's (``tests/rollout/test_prefill.py``); what is saved is ``(n - 1) / n``
of the prefill compute.

A static KV cache (default): ``DynamicCache`` concatenates every layer's whole cache at every
decoding step, ``O(length^2)`` copying that took half of a CPU decoding step at 512 rows x 192
positions (``torch.profiler``: ``aten::cat`` 49%); a ``StaticCache`` of ``width + max_new_tokens``
positions is written in place. Masked cache slots get zero attention weight, so the samples are
the ones the dynamic cache gives (``tests/rollout/test_prefill.py`` compares against plain
``model.generate``). ``generate`` would ``torch.compile`` the model on a GPU when it sees a static
cache; that is turned off (``disable_compile``): the training model's wrappers (LoRA, FSDP2
hooks) change between steps and a recompile per rollout would cost more than it saves.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.common import pad_sequences
from grimoire.forward.completions import position_ids_from_mask
from grimoire.rollout.engines.base import RolloutEngine, Samples
from grimoire.rollout.engines.generation import DrawnTokenLogps, generation_mode
from grimoire.rollout.engines.sampler_process import ASYNC_SAMPLERS


class HFGenerateEngine(RolloutEngine):
    """Samples with ``model.generate`` from the training model itself (no weight copy).

    Sampling is exactly ``softmax(logits / temperature)`` restricted by ``top_k`` (0 = off) and
    ``top_p`` (1.0 = off): a fresh ``GenerationConfig`` is used, so processors from the model's
    own ``generation_config`` (repetition penalties, a default top-k of 50, ...) cannot make the
    sampled distribution differ from the one the log-probs describe. Prompts are left-padded;
    generation stops at EOS; eval mode + KV cache are set around it (:func:`generation_mode`),
    which also keeps gradient checkpointing and dropout out of sampling.

    ``prefill_once`` (default on): each prompt's KV cache is computed once for its ``n``
    completions (module docstring); off, the prompt is repeated ``n`` times and prefilled ``n``
    times, as ``generate`` does by itself. ``async_sampler``: where the sampler runs with
    asynchronous rollouts (``loss.args.max_staleness >= 1``): ``"process"`` (default) a child
    process with its own copy of the weights (:mod:`grimoire.rollout.engines.sampler_process`),
    ``"thread"`` a thread of the learner's process (shares its GIL); unused when synchronous.
    ``static_cache`` (default on): a preallocated KV cache
    written in place instead of one concatenated at every step (module docstring); off, the
    ``DynamicCache`` ``generate`` uses by itself. ``settings``: the sampler settings every engine
    takes (:class:`~grimoire.rollout.engines.base.RolloutEngine`: ``max_new_tokens``, ``temperature``,
    ``top_p``, ``top_k``, ``generation_batch_size``).
    """

    def __init__(
        self,
        *,
        prefill_once: bool = True,
        static_cache: bool = True,
        async_sampler: str = "process",
        **settings: Any,
    ):
        super().__init__(**settings)
        if async_sampler not in ASYNC_SAMPLERS:
            choices = " or ".join(repr(m) for m in ASYNC_SAMPLERS)
            raise ValueError(f"async_sampler: {async_sampler!r}; expected {choices}")
        self.async_sampler = async_sampler
        self.prefill_once = prefill_once
        self.static_cache = static_cache
        #: Old log-probs recorded while decoding (:class:`DrawnTokenLogps`) instead of a
        #: scoring forward: set on the asynchronous sampler's engine, whose model IS the
        #: sampling policy (the sync stage scores with the training forward, as before).
        self.decode_logps = False

    def _generation_config(self, greedy: bool) -> Any:
        from transformers import GenerationConfig

        sampler = self.sampler
        common: dict[str, Any] = dict(
            max_new_tokens=sampler.max_new_tokens,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_ids or None,
            disable_compile=True,
        )
        if self.static_cache and not self.prefill_once:
            # With one prefill per prompt the cache is built here (_generate) and handed over.
            common["cache_implementation"] = "static"
        if greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=sampler.temperature,
            top_p=sampler.top_p,
            top_k=sampler.top_k,
            **common,
        )

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], n: int, greedy: bool) -> list[list[int]] | Samples:
        model = self.policy
        config = self._generation_config(greedy)
        out: list[list[int]] = []
        logps: list[list[float]] = []  # with decode_logps: the drawn tokens', per row
        chunks = self.prompt_chunks(prompts, n)
        # Sharded: every rank makes as many generate calls (fillers: a pad-token prompt, output
        # dropped), and synced_gpus keeps each call stepping until every rank's is done.
        fillers = self.agree(len(chunks)) - len(chunks) if self.agree is not None else 0
        synced = {"synced_gpus": True} if self.agree is not None else {}
        with generation_mode(model):
            for group in chunks + [[[self.pad_token_id]]] * fillers:
                recorder = DrawnTokenLogps(self.sampler.temperature) if self.decode_logps else None
                with self.autocast():
                    gen, width = self._generate(group, n, config, synced, recorder)
                out.extend(gen[:, width:].tolist())
                if recorder is not None:
                    logps.extend(recorder.finish(gen, gen.shape[1] - width).tolist())
        rows = len(prompts) * n
        if not self.decode_logps:
            return out[:rows]
        return Samples(out[:rows], logps[:rows], policy=True)

    def _generate(
        self,
        group: list[list[int]],
        n: int,
        config: Any,
        synced: dict[str, bool],
        recorder: DrawnTokenLogps | None = None,
    ) -> tuple[Tensor, int]:
        """``(generate's output [P * n, width + new], width)`` for the prompts of ``group``."""
        # A transformers (or peft) model: ``generate`` is not an nn.Module member.
        model: Any = self.policy
        device = self.device
        # Width >= 2 so the shared prefill (all but the last token) is never empty: under
        # sharding every rank must run it, fillers included (each forward is a collective).
        ids, mask = pad_sequences(group, self.pad_token_id, left=True, min_width=2)
        ids, mask = ids.to(device), mask.to(device)
        kwargs: dict[str, Any] = {}
        with warnings.catch_warnings():
            # transformers >= 5.2x renames generate's past_key_values to cache (until 6.0 both
            # work); the old name is the one every transformers 5.x accepts.
            warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated")
            if self.prefill_once:
                cache = None
                if self.static_cache:
                    cache = _static_cache(model.config, ids.shape[1] + self.sampler.max_new_tokens)
                kwargs["past_key_values"] = _shared_prefill(model, ids, mask, n, cache)
            if recorder is not None:
                from transformers import LogitsProcessorList

                kwargs["logits_processor"] = LogitsProcessorList([recorder])
            gen = model.generate(
                input_ids=ids.repeat_interleave(n, dim=0),
                attention_mask=mask.repeat_interleave(n, dim=0),
                generation_config=config,
                **synced,
                **kwargs,
            )
        return gen, ids.shape[1]


def _static_cache(config: Any, positions: int) -> Any:
    """An empty ``StaticCache`` of ``positions`` slots per row for a model of ``config`` (a
    transformers ``PretrainedConfig``); its rows are allocated by the first forward that writes
    to it (the prefill's ``P`` rows)."""
    from transformers import StaticCache

    return StaticCache(config=config.get_text_config(decoder=True), max_cache_len=positions)


def _shared_prefill(
    model: torch.nn.Module, ids: Tensor, mask: Tensor, n: int, cache: Any = None
) -> Any:
    """The KV cache of ``ids[:, :-1]`` (``[P, L - 1]``, left-padded) repeated ``n`` times along
    the batch, for ``generate`` to continue from with the ``P * n`` repeated rows.

    Positions are the ones ``generate`` gives left-padded rows (``cumsum(mask) - 1``), so the
    cached keys are those its own prefill would have written; ``logits_to_keep=1`` keeps the
    ``[P, L, V]`` logits from being built. ``cache``: the cache to fill (``None``: the model's
    default ``DynamicCache``).
    """
    positions = position_ids_from_mask(mask)
    out = model(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=positions[:, :-1],
        use_cache=True,
        logits_to_keep=1,
        **({} if cache is None else {"past_key_values": cache}),
    )
    # transformers >= 5.2x names the output's cache `cache` (the old name warns); 5.x before it
    # only has past_key_values.
    cache = out.get("cache")
    cache = cache if cache is not None else out.past_key_values
    _repeat_rows(cache, n)
    return cache


def _repeat_rows(cache: Any, n: int) -> None:
    """Each cached row ``n`` times in a row (``[P, ...] -> [P * n, ...]``), in place.

    Dynamic layers have this as a method; transformers' static layers do not, so their
    preallocated ``keys`` / ``values`` (``[P, heads, slots, head_dim]``) are replaced by the
    repeated tensors and the row count they keep is updated. Nothing else in a static layer
    depends on the rows (its fill counter is per position).
    """
    from transformers.cache_utils import StaticLayer

    for layer in cache.layers:
        if not isinstance(layer, StaticLayer):
            layer.batch_repeat_interleave(n)
            continue
        # The prefill has written to this layer, so its tensors exist.
        assert layer.keys is not None and layer.values is not None
        layer.keys = layer.keys.repeat_interleave(n, dim=0)
        layer.values = layer.values.repeat_interleave(n, dim=0)
        layer.batch_size = layer.keys.shape[0]


__all__ = ["HFGenerateEngine"]
