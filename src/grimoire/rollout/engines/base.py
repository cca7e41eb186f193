"""Rollout engines: sample G completions per prompt from the current policy, with old log-probs.

The interface online methods use is one call::

    rollout = engine.generate(prompts, n)      # prompts: list[list[int]] (token ids, no padding)

returning a :class:`Rollout` of ``N = len(prompts) * n`` rows, **prompt-major** (rows
``i*n .. i*n+n-1`` are prompt ``i``'s group). Methods never see the backend.

An engine owns its sampler settings (:class:`SamplerConfig`: temperature, top-p, top-k,
max_new_tokens, seed, importance-sampling cap), given at construction and checked once; the
limits only the run knows (token budget, context length, the sharded ranks' ``agree``) come
with :meth:`RolloutEngine.bind`.

Adding a backend (e.g. vLLM): subclass :class:`RolloutEngine` and implement

- ``_sample(prompts, n, greedy) -> list[list[int]] | Samples`` (abstract): the completion token
  ids per row (any length up to ``max_new_tokens``; an EOS, if produced, ends the completion
  and is kept), or :class:`Samples` with the sampler's own per-token log-probs too (they become
  :attr:`Rollout.sampler_logps`, for the importance-sampling correction);
- ``sync_weights()`` (optional): push the trained weights to the backend's copy. The methods
  call it once before every rollout batch. The HF backend samples from the training model
  itself, so it is a no-op there;
- ``_attach()`` (optional): start or reach the backend once :meth:`RolloutEngine.bind` has
  attached the model.

The base class pads and masks the completions and computes the *old* log-probs with the training
policy (a no-grad forward in the trainer's autocast), so every backend yields the same
log-probs the loss will be compared with, whatever precision the sampler used.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.common import pad_sequences
from grimoire.forward.completions import completion_logps
from grimoire.forward.sequence_split import from_leader
from grimoire.rollout.engines.sampler import SamplerConfig


@dataclass
class Rollout:
    """``N`` sampled completions of ``N / group_size`` prompts, prompt-major.

    Attributes:
        prompt_ids: ``[N, P]`` long, LEFT-padded prompts (each repeated ``group_size`` times).
        prompt_mask: ``[N, P]`` long, 1 on real prompt tokens.
        completion_ids: ``[N, C]`` long, RIGHT-padded completions (pad after the first EOS).
        completion_mask: ``[N, C]`` long, 1 on completion tokens up to and including the first
            EOS; ``C`` is the longest completion of the batch (``<= max_new_tokens``).
        old_logps: ``[N, C]`` float32 per-token log-probs of the completion under the policy
            that sampled it (temperature-scaled), 0 on padding; ``None`` if not requested.
        group_size: ``G``, completions per prompt.
        truncated: ``[N]`` bool, True where no EOS was produced within ``max_new_tokens``.
        sampler_logps: ``[N, C]`` float32 per-token log-probs the SAMPLER reported for its own
            samples (e.g. vLLM's), 0 on padding; ``None`` for a backend that samples from the
            training model itself (HF). With them the policy-gradient losses correct for the
            sampler/learner mismatch (truncated importance sampling).
        completion_attention: ``[N, C]`` long, 1 on every real token after the prompt, when it
            differs from the loss mask ``completion_mask`` (a multi-turn episode: tool results
            and environment messages are read, never trained); ``None``: the same.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    old_logps: Tensor | None
    group_size: int
    truncated: Tensor
    sampler_logps: Tensor | None = None
    completion_attention: Tensor | None = None

    @property
    def input_ids(self) -> Tensor:
        """``[N, P + C]`` prompt then completion."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """``[N, P + C]``: left pads and completion padding are 0."""
        return torch.cat([self.prompt_mask, self.completion_attended], dim=1)

    @property
    def completion_attended(self) -> Tensor:
        """``[N, C]``: the real completion tokens (the attention's part after the prompt)."""
        a = self.completion_attention
        return self.completion_mask if a is None else a

    @property
    def num_groups(self) -> int:
        return self.prompt_ids.shape[0] // self.group_size


@dataclass
class Samples:
    """What ``_sample`` may return instead of bare ids: the completions and, per token, the
    log-prob the sampler gave the token it drew (same lengths as ``ids``). ``policy``: True when
    those are the bound policy's own temperature-scaled log-probs (the HF engine recording them
    while decoding): they are then the old log-probs, with no scoring forward and no mismatch
    to correct (no ``sampler_logps``)."""

    ids: list[list[int]]
    logps: list[list[float]] | None = None
    policy: bool = False


#: ``agree(n)``: the largest ``n`` over the ranks (a sharded policy's engines must all make as
#: many forwards: each one is a collective).
Agree = Callable[[int], int]


class RolloutEngine(ABC):
    """Backend-independent part of a rollout engine (see the module docstring).

    Its sampler settings (:class:`SamplerConfig`, :attr:`sampler`) are given at construction and
    checked there, once; a backend's own ``__init__`` takes its own arguments and passes the rest
    (``**settings``) up (its signature then lists them too). Call :meth:`bind` once (the rollout
    stage does it when the trainer is built) with the training model and the run's limits;
    then :meth:`generate`.

    ``generation_batch_size`` caps how many sequences one sampling call and one log-prob forward
    process at a time (memory), never the results. ``max_tokens`` (given to :meth:`bind`;
    ``TrainingConfig.max_tokens_per_device``) caps the tokens of one such call:
    ``rows x (longest prompt + max_new_tokens)`` for sampling (the KV cache's final size),
    ``rows x width`` for scoring. A prompt group is never split.
    """

    def __init__(
        self,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generation_batch_size: int | None = None,
    ):
        self.sampler = SamplerConfig(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generation_batch_size=generation_batch_size,
        )
        #: The token budget of one sampling call / scoring forward (from :meth:`bind`).
        self.max_tokens: int | None = None
        #: The run's context limit (from :meth:`bind`): prompt + completion never exceed it.
        self.max_length: int | None = None
        #: Set when the policy is sharded (FSDP2): every forward is a collective, so all ranks
        #: must run as many; the engine pads its sampling and scoring calls up to the agreed
        #: count, and sampling runs with ``synced_gpus``.
        self.agree: Agree | None = None
        self.model: torch.nn.Module | None = None
        self.pad_token_id = 0
        self.eos_token_ids: list[int] = []
        self.autocast: Callable[[], AbstractContextManager[Any]] = nullcontext

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass ``__init__`` ending in ``**settings`` (passed on up) gets its base's
        arguments in its signature, so ``help()`` and the YAML check of ``engine.args``
        (:func:`~grimoire.rollout.engines.backends.engine_problems`) see every argument it takes."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        own = list(inspect.signature(init).parameters.values())
        if not any(p.kind is p.VAR_KEYWORD for p in own):
            return
        parent = next(b for b in cls.__mro__[1:] if "__init__" in b.__dict__)
        params = [p for p in own if p.kind is not p.VAR_KEYWORD]
        names = {p.name for p in params}
        inherited = list(inspect.signature(parent.__dict__["__init__"]).parameters.values())[1:]
        params += [p.replace(kind=p.KEYWORD_ONLY) for p in inherited if p.name not in names]
        init.__signature__ = inspect.Signature(params)

    def bind(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_id: int | list[int] | tuple[int, ...] | None,
        autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
        *,
        max_tokens: int | None = None,
        max_length: int | None = None,
        agree: Agree | None = None,
    ) -> None:
        """Attach the (unwrapped) training model, the special ids, the autocast factory and the
        run's limits (``max_tokens``: token budget per call; ``max_length``: the context limit;
        ``agree``: set when the policy is sharded), then :meth:`_attach` the backend."""
        self.model = model
        self.pad_token_id = int(pad_token_id)
        eos = list(eos_token_id) if isinstance(eos_token_id, list | tuple) else [eos_token_id]
        self.eos_token_ids = [int(e) for e in eos if e is not None]
        self.autocast = autocast
        self.max_tokens, self.max_length, self.agree = max_tokens, max_length, agree
        self._attach()

    def _attach(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """What a backend does once bound (start or reach its sampler); nothing by default."""

    def sync_weights(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Make the sampler use the current weights; no-op when it shares the training model."""

    def sync_metrics(self) -> dict[str, float]:
        """Metrics of the last weight sync (a separate sampler's), logged with the rollout's."""
        return {}

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Release what the backend holds (processes, memory); no-op when it holds nothing."""

    @abstractmethod
    def _sample(self, prompts: list[list[int]], n: int, greedy: bool) -> list[list[int]] | Samples:
        """The ``len(prompts) * n`` completions, prompt-major (module docstring)."""

    @property
    def policy(self) -> torch.nn.Module:
        """The bound training model."""
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.bind(model, ...) must be called first")
        return self.model

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    @contextmanager
    def turn_limit(self, max_new_tokens: int) -> Iterator[None]:
        """Sample at most ``max_new_tokens`` per completion inside the block (what a multi-turn
        episode has left); the sampler's own ``max_new_tokens`` stays the ceiling."""
        kept = self.sampler
        limit = max(1, min(kept.max_new_tokens, max_new_tokens))
        self.sampler = replace(kept, max_new_tokens=limit)
        try:
            yield
        finally:
            self.sampler = kept

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        with_old_logps: bool = True,
        greedy: bool = False,
    ) -> Rollout:
        """Sample ``n`` completions for each prompt (see :class:`Rollout` for the layout).

        ``with_old_logps=False`` skips the extra forward when the loss does not need it (e.g.
        a single policy update per rollout, where old == current log-probs in value).
        """
        device = self.device  # unbound: the error names bind()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs a non-empty list of non-empty prompts")
        # Under sequence parallelism one rank of the group samples (unsplit) for the group; a
        # sharded policy's other ranks sample too (their forwards are collectives), unused.
        sharded = self.agree is not None
        samples = from_leader(lambda: self._sample(prompts, n, greedy), everyone=sharded)
        if not isinstance(samples, Samples):
            samples = Samples(samples)
        rows = [self._cut_at_eos(c[: self.sampler.max_new_tokens]) for c in samples.ids]
        repeated = [p for p in prompts for _ in range(n)]
        if len(rows) != len(repeated):
            raise RuntimeError(
                f"{type(self).__name__}._sample returned {len(rows)} completions for "
                f"{len(prompts)} prompts x {n}"
            )
        prompt_ids, prompt_mask = pad_sequences(repeated, self.pad_token_id, left=True)
        # Empty completions (a sampler that stopped at once) still get one slot so C >= 1.
        completion_ids, completion_mask = pad_sequences(
            rows, self.pad_token_id, left=False, min_width=1
        )
        truncated = torch.tensor(
            [not (r and r[-1] in self.eos_token_ids) for r in rows], dtype=torch.bool
        )
        rollout = Rollout(
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            old_logps=None,
            group_size=n,
            truncated=truncated.to(device),
        )
        if samples.logps is not None:  # cut like the ids: a row's log-probs end with its tokens
            width = completion_ids.shape[1]
            logps = torch.zeros((len(rows), width), dtype=torch.float32)
            for i, (row, lp) in enumerate(zip(rows, samples.logps)):
                logps[i, : len(row)] = torch.tensor(lp[: len(row)], dtype=torch.float32)
            if samples.policy:
                rollout.old_logps = logps.to(device) if with_old_logps else None
                return rollout
            rollout.sampler_logps = logps.to(device)
        if with_old_logps:
            rollout.old_logps = self.score(rollout.input_ids, rollout.attention_mask, rollout)
        return rollout

    @torch.no_grad()
    def score(self, input_ids: Tensor, attention_mask: Tensor, rollout: Rollout) -> Tensor:
        """Old log-probs ``[N, C]`` of the rollout's completions under the bound model.

        Runs in the model's current train/eval mode, so it matches the training forward (with
        dropout on, ratio noise remains: disable dropout for online RL).
        """
        c = rollout.completion_ids.shape[1]
        chunk = self.sampler.generation_batch_size or input_ids.shape[0]
        if self.max_tokens:  # padded rows: each costs the full width
            chunk = max(1, min(chunk, self.max_tokens // input_ids.shape[1]))
        starts = range(0, input_ids.shape[0], chunk)
        # Agreed before any forward: a rank still in a real forward must not meet another's
        # all-reduce (every forward of a sharded policy is itself a collective).
        total = self.agree(len(starts)) if self.agree is not None else len(starts)
        out = []
        for s in starts:
            with self.autocast():
                logps, _ = completion_logps(
                    self.policy,
                    input_ids[s : s + chunk],
                    attention_mask[s : s + chunk],
                    c,
                    self.sampler.temperature,
                )
            out.append(logps)
        # Sharded: fillers rerun the first row through the very same path, so every rank makes
        # the same collectives (the decoder's gathers and, on the fused path, the head's own).
        for _ in range(total - len(starts)):
            with self.autocast():
                completion_logps(
                    self.policy, input_ids[:1], attention_mask[:1], c, self.sampler.temperature
                )
        return torch.cat(out) * rollout.completion_mask

    def prompt_chunks(self, prompts: list[list[int]], n: int) -> list[list[list[int]]]:
        """Consecutive runs of whole prompts, one sampling call each: at most
        ``generation_batch_size`` rows and, with ``max_tokens``, at most that many tokens once
        the ``n`` completions per prompt are full (left padding to the run's longest included).
        A prompt that alone exceeds ``max_tokens`` still gets its own call: the trainer rejects
        such rows before training, so this only happens when the engine is used on its own."""
        rows_cap = max(self.sampler.generation_batch_size or len(prompts) * n, n)
        runs: list[list[list[int]]] = []
        longest = 0  # of the current run
        for p in prompts:
            width = max(longest, len(p)) + self.sampler.max_new_tokens
            rows = (len(runs[-1]) + 1) * n if runs else 0
            if (
                runs
                and rows <= rows_cap
                and (not self.max_tokens or rows * width <= self.max_tokens)
            ):
                runs[-1].append(p)
                longest = max(longest, len(p))
            else:
                runs.append([p])
                longest = len(p)
        return runs

    def _cut_at_eos(self, ids: list[int]) -> list[int]:
        for i, t in enumerate(ids):
            if t in self.eos_token_ids:
                return list(ids[: i + 1])
        return list(ids)


__all__ = [
    "Agree",
    "Rollout",
    "RolloutEngine",
    "SamplerConfig",
    "Samples",
]
