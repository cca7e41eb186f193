"""The rollout stage of a step: sample, score, build the training micro-batches, report.

For methods that generate (``needs_generation``), the trainer calls :meth:`RolloutStage.step`
on the step's prompt micro-batches BEFORE any loss runs:

1. every REAL prompt micro-batch is sampled (``G = num_generations`` completions per prompt, by
   the :class:`~grimoire.rollout.engines.base.RolloutEngine`) and scored by the reward functions;
   rank-sync dummies (keep 0) are not sampled at all;
2. every group is laid out as one padded batch (:attr:`ScoredGroup.batch`, with its reference
   log-probs when there is a reference), and the step's scored groups become training
   micro-batches through the ``build_batches(ctx, groups)`` callable the stage was given (the
   method's: it selects rows of those batches), so statistics over "the batch" see exactly the
   real groups of the whole step (and, through ``ctx.all_reduce_sum``, of every rank); the
   selections are packed here when the run is padding-free;
3. dummies get a placeholder batch (loss 0, 0 loss units), keeping their place and flag;
4. the stage reports the rollout metrics (rewards per function, completion lengths, clip ratio,
   timings) with the number of completions as their weight.

With ``steps_per_batch > 1`` (GRPO's ``num_iterations``) the planner repeats a global batch for
that many optimizer steps and the stage reuses the first step's training batches: same
completions, same old log-probs (PPO's epochs over one rollout).

The stage knows no method: it is built from explicit parts (engine, reward functions, sampling
settings, the ``build_batches`` and ``reference_logps`` callables, ``steps_per_batch``), so
whoever builds it (the trainer, from a :data:`RolloutMethod`'s members) owns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.prompts import prompt_token_lists
from grimoire.columns import pad_token_id_of
from grimoire.config.context import TrainingContext
from grimoire.contract.method import GeneratingMethod
from grimoire.rollout.agents.agent import Agent, episode_rollout
from grimoire.rollout.agents.episode_batches import (
    engine_generate_batch,
    episode_scoring,
    final_answer,
    play_groups,
)
from grimoire.rollout.agents.episodes import sum_metrics
from grimoire.rollout.batches import pack_rollout_batch, placeholder_batch, training_batch
from grimoire.rollout.engines.base import Rollout, RolloutEngine
from grimoire.rollout.engines.sampler import SamplerConfig
from grimoire.rollout.rewards.background import BackgroundScoring
from grimoire.rollout.rewards.calls import NOT_COLUMNS, RewardFunction
from grimoire.rollout.rewards.scoring import score_completions
from grimoire.rollout.rewards.statistics import equal_reward_groups, reward_std


def completion_token_lists(rollout: Rollout) -> list[list[int]]:
    """Each completion's sampled token ids (its mask's tokens: EOS included when it has one)."""
    return [
        ids[m.bool()].tolist()
        for ids, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())
    ]


@dataclass(frozen=True, kw_only=True)
class SamplingConfig(SamplerConfig):
    """How a method's completions are sampled: ``num_generations`` (``G``, read by the stage)
    and the engine's sampler settings (:class:`~grimoire.rollout.engines.sampler.SamplerConfig`;
    ``top_k=0`` and ``top_p=1`` switch those filters off). Keyword arguments only."""

    num_generations: int = 8

    @classmethod
    def of(cls, sampler: SamplerConfig, num_generations: int) -> SamplingConfig:
        """``sampler``'s settings (an engine's) with ``G = num_generations``."""
        return cls(num_generations=num_generations, **asdict(sampler))


@dataclass
class ScoredGroup:
    """One prompt micro-batch's rollout: ``N = prompts x G`` completions, prompt-major."""

    prompts: dict[str, Any]
    rollout: Rollout
    rewards: Tensor  # [N] weighted total
    per_func: dict[str, Tensor] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    #: The padded training batch of every completion (``input_ids``, ``attention_mask``,
    #: ``completion_mask``, old / sampler log-probs), set by the stage before ``build_batches``:
    #: a method selects its rows (:func:`grimoire.forward.completions.select_rows`).
    batch: dict[str, Any] = field(default_factory=dict)
    #: ``[N, C]`` reference log-probs of every completion (masked), when the method needs them.
    ref_logps: Tensor | None = None
    #: Episode metrics summed over the group's episodes (tool outcomes, failures, turns).
    episode_metrics: dict[str, float] = field(default_factory=dict)
    #: Counts the reward functions returned with their rewards (``rewards/<name>/failures``).
    reward_metrics: dict[str, float] = field(default_factory=dict)


#: ``build_batches(ctx, groups) -> (training micro-batches, metrics)``: one batch per group.
BuildBatches = Callable[
    [TrainingContext, list[ScoredGroup]], tuple[list[dict[str, Any]], dict[str, float]]
]
#: ``reference_logps(training_batch) -> [N, C]`` reference log-probs of its completions.
ReferenceLogps = Callable[[dict[str, Any]], Tensor]
#: The contract's generating method with the rollout's own types: what a stage's parts come from.
RolloutMethod = GeneratingMethod[RolloutEngine, RewardFunction, SamplingConfig, ScoredGroup]


def environment_rows(prompts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dataset rows of a collated prompt batch, as an environment's ``reset`` takes them:
    every column but the token ids, with a chat prompt as its messages (``prompt_messages``),
    not the rendered text (an environment given the text would wrap the whole transcript in
    one user turn)."""
    n = len(prompts["prompt"])
    rows = []
    for i in range(n):
        row = {
            k: v[i]
            for k, v in prompts.items()
            if k not in ("prompt_input_ids", "prompt_attention_mask") and isinstance(v, list)
        }
        messages = row.pop("prompt_messages", None)
        if messages is not None:
            row["prompt"] = messages
        rows.append(row)
    return rows


class RolloutStage:
    """Sampling and scoring for one online method (see the module docstring).

    Args:
        engine: samples the completions (bound to the policy by :meth:`bind`).
        reward_funcs: score them (:func:`~grimoire.rollout.rewards.scoring.resolve_reward_funcs`).
        sampling: ``num_generations`` (``G``) is read here; the engine holds the rest.
        build_batches: turns the step's scored groups into training micro-batches.
        steps_per_batch: optimizer steps per rollout batch (the batches are reused that often).
        needs_old_logps: sample with the sampling policy's log-probs (an extra no-grad pass).
        reference_logps: when given, every group's reference log-probs are computed before
            ``build_batches`` (:attr:`ScoredGroup.ref_logps`).
        agent: when given, each prompt's ``G`` samples are multi-turn episodes
            (:mod:`grimoire.rollout.agents.agent`) played with the engine, scored as whole episodes.

    A reward function that declares ``overlap_sampling`` (an LLM judge) makes the stage score
    each prompt micro-batch in the background while the next one samples
    (:mod:`grimoire.rollout.rewards.background`; ``overlap``).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        reward_funcs: Sequence[RewardFunction],
        sampling: SamplingConfig,
        build_batches: BuildBatches,
        *,
        steps_per_batch: int = 1,
        needs_old_logps: bool = False,
        reference_logps: ReferenceLogps | None = None,
        agent: Agent | None = None,
    ):
        self.engine = engine
        self.reward_funcs = list(reward_funcs)
        self.sampling = sampling
        self.build_batches = build_batches
        self.steps_per_batch = max(1, int(steps_per_batch))
        self.needs_old_logps = needs_old_logps
        self.reference_logps = reference_logps
        self.agent = agent
        #: Score in the background while the next micro-batch samples (same results).
        self.overlap = any(rf.overlap_sampling for rf in self.reward_funcs)
        self.tokenizer: Any = None
        self.sharded = False
        self.pad_token_id = 0
        self._cache: tuple[tuple[int, int], list[tuple[dict, float]], dict, float] | None = None
        self._last_step_start: float | None = None

    def bind(self, ctx: TrainingContext) -> None:
        """Attach the engine to the policy, with the run's limits (token budget, context length,
        the ranks' agreement when sharded) and autocast."""
        policy, tok = ctx.unwrapped_model, ctx.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            eos = getattr(getattr(policy, "config", None), "eos_token_id", None)
        self.pad_token_id = pad_token_id_of(tok, policy)
        if self.agent is not None and self.agent.stop_tokens:  # the template's end of turn
            given = eos if isinstance(eos, list | tuple) else [eos]
            listed: list[int] = [int(e) for e in given if e is not None]
            eos = listed + [int(tok.convert_tokens_to_ids(t)) for t in self.agent.stop_tokens]
        self.engine.bind(
            policy,
            self.pad_token_id,
            eos,
            ctx.accelerator.autocast,
            max_tokens=ctx.config.max_tokens_per_device,
            max_length=ctx.config.max_length,
            # Every forward of a sharded policy is a collective: the ranks agree on their count.
            agree=ctx.all_reduce_max if ctx.sharded else None,
        )
        self.tokenizer = tok
        self.sharded = ctx.sharded

    def close(self) -> None:
        """Shut the engine down (the trainer's ``close``, before the process group goes) and
        what the agent holds open (MCP connections)."""
        self.engine.close()
        if self.agent is not None:
            self.agent.close()

    # ------------------------------------------------------------------ one step

    def step(
        self, ctx: TrainingContext, micro: list[tuple[dict[str, Any], float]]
    ) -> tuple[list[tuple[dict[str, Any], float]], dict[str, float], float]:
        """``(training micro-batches with their keep flags, rollout metrics, their weight)``."""
        now = time.perf_counter()
        timing: dict[str, float] = {}
        if self._last_step_start is not None:
            timing["time/step"] = now - self._last_step_start  # the previous step, end to end
        self._last_step_start = now
        repeat = self.steps_per_batch
        key = (ctx.step.epoch, ctx.step.step_in_epoch // repeat)
        if repeat > 1 and self._cache is not None and self._cache[0] == key:
            _, batches, metrics, weight = self._cache
            reused = {**metrics, **timing, "time/generation": 0.0, "time/rollout": 0.0}
            return batches, reused, weight

        groups, fillers = self.scored_groups(ctx, micro)
        t_gen = time.perf_counter() - now
        self.prepare(ctx, groups, fillers, micro[0][0])
        built, extra = self.build_batches(ctx, groups)
        # The method selected rows of padded batches; the run's layout is applied here.
        real = iter([pack_rollout_batch(b) for b in built] if ctx.packed else built)
        batches = [
            (next(real), keep)
            if keep
            else (placeholder_batch(prompts, self.pad_token_id, ctx.packed), keep)
            for prompts, keep in micro
        ]
        metrics, weight = self.metrics(groups)
        metrics.update(extra)
        metrics.update({"time/generation": t_gen, "time/rollout": time.perf_counter() - now})
        if repeat > 1:
            self._cache = (key, batches, dict(metrics), weight)
        metrics.update(timing)
        return batches, metrics, weight

    def prepare(
        self, ctx: TrainingContext, groups: list[ScoredGroup], fillers: int, prompts: dict[str, Any]
    ) -> None:
        """What ``build_batches`` reads besides the rewards: every group's padded batch of every
        row (:attr:`ScoredGroup.batch`) and, with a reference, their reference log-probs
        (scored in the run's layout; ``fillers`` passes on a placeholder of ``prompts`` keep a
        sharded policy's ranks in step)."""
        for group in groups:
            group.batch = training_batch(group.rollout, range(group.rewards.numel()), False)
        if self.reference_logps is None:
            return
        for group in groups:  # every row's reference log-probs; methods select rows
            scored = pack_rollout_batch(group.batch) if ctx.packed else group.batch
            group.ref_logps = self.reference_logps(scored)
        filler = placeholder_batch(prompts, self.pad_token_id, ctx.packed)
        for _ in range(fillers):
            self.reference_logps(filler)

    def feed(self, batches: Iterable[Any], first_step: int, in_epoch: int = 0) -> Iterable[Any]:
        """The epoch's prompt micro-batches, in the planner's order, as the trainer walks them
        (``first_step``: the global step of the first, ``in_epoch`` its index in the epoch).
        Synchronous: unchanged; an asynchronous stage
        (:mod:`grimoire.rollout.async_rollouts`) reads ahead of the learner here."""
        return batches

    def scored_groups(
        self, ctx: TrainingContext, micro: list[tuple[dict[str, Any], float]]
    ) -> tuple[list[ScoredGroup], int]:
        """The step's real groups, sampled now by the policy, and the number of filler calls.

        Sharded policy: every forward is a collective, so every rank runs as many sampling
        calls and reference passes (fillers on a pad token), all before build_batches, whose
        step statistics are all-reduces of their own.
        """
        self.engine.sync_weights()
        g, old = self.sampling.num_generations, self.needs_old_logps
        with BackgroundScoring[ScoredGroup](self.overlap) as scoring:
            for prompts, keep in micro:
                if keep and self.agent is not None:
                    scoring.submit(self.play_later(prompts))
                elif keep:
                    tokens = prompt_token_lists(prompts)
                    rollout = self.engine.generate(tokens, g, with_old_logps=old)
                    scoring.submit(self.score_later(prompts, rollout))
            real = sum(1 for _, keep in micro if keep)
            fillers = ctx.all_reduce_max(real) - real if self.sharded else 0
            for _ in range(fillers):
                self.engine.generate([[self.pad_token_id]], g, with_old_logps=old)
            return scoring.results(), fillers

    def play(
        self, prompts: dict[str, Any], greedy: bool = False, engine: RolloutEngine | None = None
    ) -> ScoredGroup:
        """``G`` episodes per prompt (prompt-major; one, greedy, for evaluation), scored as whole
        episodes; old log-probs scored by the policy over each whole episode (the sampler's
        stay ``sampler_logps``). ``engine``: the one that plays and scores them (default: the
        stage's; the asynchronous stage passes its sampler's copy)."""
        return self.play_later(prompts, greedy, engine)()

    def play_later(
        self, prompts: dict[str, Any], greedy: bool = False, engine: RolloutEngine | None = None
    ) -> Callable[[], ScoredGroup]:
        """:meth:`play`'s episodes played now; the returned call runs the reward functions."""
        agent, g = self.agent, 1 if greedy else self.sampling.num_generations
        engine = self.engine if engine is None else engine
        assert agent is not None
        rows = environment_rows(prompts)
        turns = engine_generate_batch(engine, greedy)
        stops = engine.eos_token_ids
        episodes = play_groups(
            rows, agent.env_factory, turns, self.tokenizer, agent.parser, g, agent.limits, stops
        )
        device = prompts["prompt_input_ids"].device
        rollout = episode_rollout(episodes, self.pad_token_id, g, device)
        if self.needs_old_logps and not greedy:
            rollout.old_logps = engine.score(rollout.input_ids, rollout.attention_mask, rollout)
        repeated = [row for row in rows for _ in range(g)]
        rewards = episode_scoring(self.reward_funcs, episodes, repeated, self.tokenizer)
        texts = [final_answer(e) for e in episodes]

        def scored() -> ScoredGroup:
            counts: dict[str, float] = {}
            total, per_func = rewards(counts)
            return ScoredGroup(
                prompts,
                rollout,
                total.to(device),
                {k: v.to(device) for k, v in per_func.items()},
                texts,
                episode_metrics=sum_metrics(episodes),
                reward_metrics=counts,
            )

        return scored

    def score(self, prompts: dict[str, Any], rollout: Rollout) -> ScoredGroup:
        """Decode the completions and run the reward functions on them."""
        return self.score_later(prompts, rollout)()

    def score_later(self, prompts: dict[str, Any], rollout: Rollout) -> Callable[[], ScoredGroup]:
        """The completions decoded now, by the calling thread (which owns the tokenizer); the
        returned call runs the reward functions (:mod:`grimoire.rollout.rewards.background`)."""
        g = rollout.group_size
        ids = completion_token_lists(rollout)
        texts = list(self.tokenizer.batch_decode(ids, skip_special_tokens=True))
        columns = {
            k: [v for v in values for _ in range(g)]
            for k, values in prompts.items()
            if k not in NOT_COLUMNS and isinstance(values, list)
        }
        repeated = [p for p in prompts["prompt"] for _ in range(g)]
        device = rollout.completion_ids.device

        def scored() -> ScoredGroup:
            counts: dict[str, float] = {}
            total, per_func = score_completions(
                self.reward_funcs, repeated, texts, columns, device, ids, counts
            )
            return ScoredGroup(prompts, rollout, total, per_func, texts, reward_metrics=counts)

        return scored

    def decode(self, rollout: Rollout) -> list[str]:
        """Completion texts (special tokens, e.g. EOS, skipped)."""
        rows = completion_token_lists(rollout)
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))

    def metrics(self, groups: list[ScoredGroup]) -> tuple[dict[str, float], float]:
        """Rollout metrics over this rank's real groups and their weight (completions), so the
        trainer's one reduction averages them over every rank's completions."""
        if not groups:
            return {}, 0.0
        rewards = torch.cat([g.rewards for g in groups]).float()
        lengths = torch.cat([g.rollout.completion_mask.sum(-1) for g in groups]).float()
        clipped = torch.cat([g.rollout.truncated for g in groups]).float()
        flat = torch.cat([equal_reward_groups(g.rewards, g.rollout.group_size) for g in groups])
        out = {
            "rewards/mean": float(rewards.mean()),
            "rewards/std": reward_std(rewards.tolist()),
            "completions/mean_length": float(lengths.mean()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(clipped.mean()),
            "frac_reward_zero_std": float(flat.float().mean()),
        }
        # TRL's GRPO/RLOO names for the same two numbers (users' dashboards look for them).
        out["reward"], out["reward_std"] = out["rewards/mean"], out["rewards/std"]
        out.update(self.engine.sync_metrics())
        episodes: dict[str, float] = {}
        for group in groups:  # summed counts; the means weighted by the group's episodes
            for k, v in group.episode_metrics.items():
                episodes[k] = episodes.get(k, 0.0) + v
        for k in [k for k in episodes if k.endswith("_mean")]:
            episodes[k] = sum(g.episode_metrics.get(k, 0.0) * g.rewards.numel() for g in groups)
            episodes[k] /= float(rewards.numel())
        out.update(episodes)
        for group in groups:  # the reward functions' counts (an LLM judge's failures), summed
            for k, v in group.reward_metrics.items():
                out[k] = out.get(k, 0.0) + v
        for name in groups[0].per_func:
            r = torch.cat([g.per_func[name] for g in groups]).float()
            out[f"rewards/{name}/mean"] = float(r.mean())
            out[f"rewards/{name}/std"] = reward_std(r.tolist())
        return out, float(rewards.numel())

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, prompts: dict[str, Any]) -> tuple[Tensor, dict[str, float]]:
        """One GREEDY completion (or episode) per prompt, scored: ``eval/loss`` is minus the mean total
        reward (lower is better, like a loss); per-function means are logged too."""
        if self.agent is not None:  # one greedy episode per prompt
            group = self.play(prompts, greedy=True)
        else:
            rollout = self.engine.generate(
                prompt_token_lists(prompts), 1, with_old_logps=False, greedy=True
            )
            group = self.score(prompts, rollout)
        metrics, _ = self.metrics([group])
        metrics = {k: v for k, v in metrics.items() if not k.endswith("/std")}
        metrics.pop("frac_reward_zero_std", None)
        return -group.rewards.mean(), metrics


__all__ = [
    "BuildBatches",
    "ReferenceLogps",
    "RolloutMethod",
    "RolloutStage",
    "SamplingConfig",
    "ScoredGroup",
]
