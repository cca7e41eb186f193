"""``OnlineMethod``: what GRPO, RLOO, Online DPO and RAFT share.

How an online method plugs into the one training loop (:class:`grimoire.GrimoireTrainer`):

1. The dataset holds prompts (:func:`grimoire.rows.prompts.tokenize_grpo`); each micro-batch the
   planner gives this rank is ``batch_size`` prompts (collated by ``GRPOCollator``).
2. The trainer runs the step's rollout stage first (:class:`grimoire.rollout.stage.RolloutStage`,
   which the trainer owns and builds from the parts this method declares as a
   :class:`~grimoire.contract.method.GeneratingMethod`: ``engine``, ``reward_funcs``,
   ``sampling`` and :meth:`build_batches`; the stage never holds the method): it samples
   ``G = num_generations`` completions per prompt of every real
   micro-batch, scores them, lays each group out as one padded batch, and hands the step's
   scored groups to :meth:`build_batches`, which returns one training micro-batch per group
   (rows selected from that batch, advantages, reference log-probs; the stage packs them in a
   padding-free run). Statistics over the step ("batch" reward scaling, advantage
   normalisation) are taken there, over the real groups of every rank. Those parts are built
   on the rollout side from this method's rollout settings
   (:class:`~grimoire.rollout.assembly.RolloutSettings`), and the method's log-probs come from
   :mod:`grimoire.forward.completions`: nothing here calls back into the stage's code.
3. The trainer weights each training micro-batch by :meth:`loss_weight` and back-propagates
   :meth:`__call__`'s loss.

Groups are never split: a prompt and its G completions live in one micro-batch on the rank that
owns the prompt, so per-group statistics (means, stds, leave-one-out baselines, best/worst) need
no communication.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.prompts import GRPOCollator
from grimoire.columns import columns_of

# The one core import of grimoire.compat: grimoire-rl's users build these methods in Python with
# its constructor spelling, and no entry point stands between them and the constructor.
from grimoire.compat.grimoire_rl_methods import (
    accepts_peer_spelling,
    peer_prompt_rows,
    tokenizer_problem,
)
from grimoire.config.context import TrainingContext
from grimoire.contract.layout import is_prompt_batch, num_rows
from grimoire.errors import ConfigError
from grimoire.forward.completions import batch_completion_logps, select_rows
from grimoire.forward.reference import Reference
from grimoire.losses.base import GrimoireLoss
from grimoire.losses.online_checks import (
    check_online_settings,
    check_prompt_lengths,
    warn_on_dropout,
)
from grimoire.losses.sampler_correction import SamplerCorrection, correction_parameters
from grimoire.rollout.agents.agent import Agent
from grimoire.rollout.agents.episode_batches import EPISODE_COLUMNS
from grimoire.rollout.assembly import RolloutSettings
from grimoire.rollout.engines.base import RolloutEngine
from grimoire.rollout.rewards.calls import (
    RewardFunction,
    RewardSpec,
    reward_signature_problems,
)
from grimoire.rollout.stage import RolloutMethod, SamplingConfig, ScoredGroup


class OnlineMethod(GrimoireLoss):
    """Base class of the online methods, a :class:`~grimoire.contract.method.GeneratingMethod`
    (:data:`~grimoire.rollout.stage.RolloutMethod`); see the module docstring for the flow.

    Args:
        reward_funcs, reward_weights: what scores the completions, and how much each counts.
        beta: KL / reference strength (meaning per method); ``0`` loads no reference model.
        ref_model: the frozen reference (:class:`grimoire.forward.reference.Reference`): a model,
            ``"copy"`` (a frozen copy of the starting policy: twice the memory), or None (then
            only a LoRA policy has one: its base with adapters disabled).
        log_entropy: compute the policy's token entropy as a metric (one extra softmax).
        fused, fused_chunk_size: the training log-probs (policy and reference) use the fused,
            chunked LM-head path (as every loss does by default), or the full logits with
            ``fused=False``; the rollout's own scoring is unchanged.
        importance_sampling_*, off_policy_mask_threshold (and TRL's ``vllm_`` spellings): the
            correction for a sampler that is not the learner
            (:class:`~grimoire.losses.sampler_correction.SamplerCorrection`; the methods whose
            loss is a policy gradient apply it: GRPO, RLOO, distillation's reverse KL).
        **rollout: the rest of the rollout's settings (``num_generations``, ``temperature``,
            ``top_p``, ``top_k``, ``max_new_tokens``, ``generation_batch_size``, ``engine``,
            ``max_staleness`` and the multi-turn ``tools``, ``environment``, ...), handed whole
            to :class:`~grimoire.rollout.assembly.RolloutSettings`, which documents each and
            assembles the engine, reward functions, sampling settings and agent
            (:class:`~grimoire.rollout.assembly.RolloutParts`). The signature lists them.

    Subclasses list only their own arguments and end with ``**kwargs`` passed on to this
    constructor; their signature (for the YAML CLI's checks and ``help()``) is completed with
    this one's automatically.

    grimoire-rl's spelling ``Method(reward_fn, tokenizer, ...)`` is accepted too
    (:mod:`grimoire.compat.grimoire_rl_methods`; the tokenizer must equal the trainer's).
    """

    needs_generation = True
    required_columns = ("prompt_input_ids", "prompt_attention_mask", "prompt")
    #: Smallest G the method accepts (groups need >= 2 to compare completions).
    min_generations = 2
    #: Optimizer steps per rollout batch (GRPO's num_iterations); read by the trainer's planner.
    steps_per_batch: int = 1
    #: Base arguments a subclass does not take (left out of its completed signature).
    hidden_args: tuple[str, ...] = ()
    #: Every forward of the loss is completion log-probs of packed rollout rows (policy,
    #: reference, old), which sequence parallelism splits (GRPO, RLOO set it).
    splits_sequences: bool = False
    #: A tokenizer given the grimoire-rl way (checked against the trainer's in setup).
    peer_tokenizer: Any = None
    #: The run's context, set by :meth:`setup`.
    _ctx: TrainingContext | None = None

    @accepts_peer_spelling
    def __init__(
        self,
        reward_funcs: RewardSpec | Sequence[RewardSpec],
        reward_weights: Sequence[float] | None = None,
        *,
        beta: float = 0.0,
        ref_model: torch.nn.Module | str | None = None,
        log_entropy: bool = True,
        fused: bool = True,
        fused_chunk_size: int = 1024,
        **rollout: Any,
    ):
        name = type(self).__name__
        hidden = sorted(set(rollout) & set(self.hidden_args))
        if hidden:
            raise TypeError(f"{name}.__init__() got an unexpected keyword argument {hidden[0]!r}")
        #: How the sampler/learner mismatch is corrected (taken out of the rollout settings).
        self.sampler_correction = SamplerCorrection.take(name, rollout)
        given = {"reward_funcs": reward_funcs, "reward_weights": reward_weights, **rollout}
        settings = RolloutSettings.of(name, given)
        check_online_settings(
            name, settings.num_generations, self.min_generations, beta, fused_chunk_size
        )
        parts = settings.assemble(name)
        self.engine: RolloutEngine = parts.engine
        self.reward_funcs: list[RewardFunction] = parts.reward_funcs
        self.sampling: SamplingConfig = parts.sampling
        self.agent: Agent | None = parts.agent
        #: Optimizer steps a rollout may lag the learner (>= 1: asynchronous rollouts,
        #: :mod:`grimoire.rollout.async_rollouts`); 0 samples each step with its own weights.
        self.max_staleness = parts.max_staleness
        self.beta = beta
        self.reference = Reference(ref_model, name)
        self.log_entropy = log_entropy
        self.fused = fused
        self.fused_chunk_size = fused_chunk_size

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Complete a subclass's ``**kwargs`` signature with :class:`OnlineMethod`'s arguments,
        and let its own ``__init__`` take grimoire-rl's spelling too."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            init = accepts_peer_spelling(cls.__dict__["__init__"])
            cls.__init__ = init  # type: ignore[method-assign]
        own = list(inspect.signature(cls.__init__).parameters.values())[1:]
        if not any(p.kind is p.VAR_KEYWORD for p in own):
            return
        params = [p for p in own if p.kind is not p.VAR_KEYWORD]
        names = {p.name for p in params} | set(cls.hidden_args)
        base = list(full_signature().parameters.values())
        params += [p.replace(kind=p.KEYWORD_ONLY) for p in base if p.name not in names]
        cls.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ capabilities

    @property
    def num_generations(self) -> int:
        return self.sampling.num_generations

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def needs_reference_model(self) -> bool:  # type: ignore[override]
        return self.beta > 0

    @property
    def context(self) -> TrainingContext:
        """The run's context, given to :meth:`setup` (a RuntimeError before it)."""
        if self._ctx is None:
            raise RuntimeError(f"{self.method_name}: used before setup(ctx)")
        return self._ctx

    @property
    def frozen_reference(self) -> Reference:
        """``self.reference``, which ``__init__`` sets (the contract's may be None)."""
        assert self.reference is not None, f"{self.method_name} sets its reference in __init__"
        return self.reference

    @property
    def logp_temperature(self) -> float:
        """Temperature the loss's log-probs use: the sampling one for policy-gradient methods
        (their ratios / scores are of the distribution that sampled), 1.0 for the supervised-style
        objectives (DPO, RAFT), which are about the model's own likelihood."""
        return self.temperature

    @property
    def needs_old_logps(self) -> bool:
        """Whether rollouts need the sampling policy's log-probs (extra no-grad forward)."""
        return False

    def create_collator(self, pad_token_id: int) -> GRPOCollator:
        return GRPOCollator(pad_token_id=pad_token_id)

    def create_packed_collator(self, pad_token_id: int) -> GRPOCollator:
        """Prompts are collated padded either way (the rollout engine generates from padded
        prompts); padding-free applies to the training micro-batches :meth:`build_batches`
        makes."""
        return GRPOCollator(pad_token_id=pad_token_id)

    # ------------------------------------------------------------------ token budget

    def budget_tokens(self, lengths: dict[str, int], packed: bool) -> int:
        """A prompt's unit is its group: ``G`` sequences of prompt + up to ``max_new_tokens``.

        Bounds every pass the prompt takes part in: sampling (``G`` rows whose KV cache grows to
        prompt + max_new_tokens), old-policy / reference / policy passes over the packed rollout.
        """
        if self.agent is not None:  # an episode: every token it may hold, prompt included
            return self.num_generations * self.agent.limits.max_tokens
        return self.num_generations * (lengths["prompt_"] + self.max_new_tokens)

    @property
    def budget_hint(self) -> str:  # type: ignore[override]  (computed; the base's is a constant)
        return (
            f", x num_generations={self.num_generations} with max_new_tokens="
            f"{self.max_new_tokens} each; lowering either also helps"
        )

    def fit_to_budget(self, row: dict[str, Any], budget: int) -> dict[str, Any]:
        """Keep the prompt's LAST tokens (the question and the generation prompt) so the group
        fits; the ``prompt`` text given to reward functions stays whole."""
        keep = budget // self.num_generations - self.max_new_tokens
        if keep < 1:
            return row  # cannot fit: TokenBudget.problems reports it
        return {
            **row,
            "prompt_input_ids": list(row["prompt_input_ids"][-keep:]),
            "prompt_attention_mask": list(row["prompt_attention_mask"][-keep:]),
        }

    def validate_dataset(self, dataset: Any, split: str = "train") -> list[str]:
        problems = super().validate_dataset(dataset, split)
        return problems + self.reward_problems(columns_of(dataset), split)

    def reward_problems(self, columns: Sequence[str], split: str = "train") -> list[str]:
        """Reward functions whose signature a call with these dataset columns would not fit
        (:func:`~grimoire.rollout.rewards.calls.reward_signature_problems`); episodes add their
        own columns (``messages``, ``tool_calls``, ...)."""
        passed = [*columns, *(EPISODE_COLUMNS if self.agent is not None else ())]
        return reward_signature_problems(self.reward_funcs, passed, f"{split} dataset")

    def adapt_rows(self, dataset: Any, tokenizer: Any) -> Any:
        """Rows tokenized by grimoire-rl's ``tokenize_grpo`` (``input_ids`` / ``attention_mask``
        as the prompt) read as :func:`~grimoire.rows.prompts.tokenize_grpo`'s columns."""
        return peer_prompt_rows(dataset, tokenizer)

    def setup(self, ctx: TrainingContext) -> None:
        """Check prompt lengths, place the reference."""
        self._ctx = ctx
        problem = tokenizer_problem(type(self).__name__, self.peer_tokenizer, ctx.tokenizer)
        if problem is not None:
            raise ConfigError([problem])
        check_prompt_lengths(ctx, self.max_new_tokens)
        if self.needs_reference_model:
            self.frozen_reference.setup(ctx)
        warn_on_dropout(type(self).__name__, ctx)

    # ------------------------------------------------------------------ building training batches

    def build_batches(
        self, ctx: TrainingContext, groups: list[ScoredGroup]
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """One training micro-batch per scored group, and the method's own rollout metrics.

        ``groups`` are this rank's REAL groups of the whole step (dummies are not sampled);
        every rank calls this at the same point, so an override may take step statistics with
        ``ctx.all_reduce_sum``. Default: :meth:`build_batch` per group, metrics averaged over
        completions.
        """
        batches, sums, weight = [], {}, 0.0
        for group in groups:
            batch, metrics = self.build_batch(group)
            batches.append(batch)
            n = float(group.rewards.numel())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * n
            weight += n
        return batches, {k: v / weight for k, v in sums.items()}

    def build_batch(self, group: ScoredGroup) -> tuple[dict[str, Any], dict[str, float]]:
        raise NotImplementedError

    def training_batch(self, group: ScoredGroup, rows: Sequence[int]) -> dict[str, Any]:
        """The padded training batch of ``rows`` of ``group`` (selected from the batch the stage
        built, :func:`~grimoire.forward.completions.select_rows`; the stage packs it when the
        run is padding-free), with those rows' reference log-probs as ``ref_logps [rows, C]``
        when the stage computed them."""
        batch = select_rows(group.batch, rows)
        if group.ref_logps is not None:
            mask = batch["completion_mask"]
            idx = torch.tensor(list(rows) or [0], device=group.ref_logps.device)
            batch["ref_logps"] = group.ref_logps[idx, : mask.shape[1]] * mask
        return batch

    # ------------------------------------------------------------------ forwards

    @torch.no_grad()
    def reference_logps(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[Tensor]:
        """``(ref_logps,)``: ``[N, C]`` reference log-probs of a training batch's completions
        (masked); ``model`` is the policy (a LoRA reference is it with the adapters off)."""
        with self.frozen_reference.model(model) as ref, self.context.accelerator.autocast():
            logps, _ = batch_completion_logps(
                ref, batch, self.logp_temperature, **self._fused_args()
            )
        return (logps,)

    @property
    def ratio_to_old_logps(self) -> bool:
        """Whether the loss takes its policy ratio against the rollout's ``old_logps`` (GRPO's
        surrogate). Under asynchronous rollouts the HF sampler's log-probs arrive as
        ``old_logps``; such a loss already corrects for them (PPO's clipped ratio), while a
        loss without that ratio (RLOO, distillation) takes them as the sampler's."""
        return False

    @property
    def sampler_differs(self) -> bool:
        """Whether this run's rollouts come from a sampler that is not the learner: an engine
        that returns its own log-probs (vLLM, ``importance_sampling_cap`` set), or, for a loss
        without a ratio to ``old_logps``, an asynchronous sampler. A setting of the run, not of
        a batch, so every rank (placeholder batches included) logs the same keys."""
        engine_logps = self.engine.sampler.importance_sampling_cap is not None
        return engine_logps or (self.max_staleness >= 1 and not self.ratio_to_old_logps)

    def sampler_logps(self, batch: dict[str, Any]) -> Tensor | None:
        """The log-probs the sampler gave its tokens where they are not the learner's (see
        :attr:`sampler_differs`): vLLM's ``sampler_logps``, else an asynchronous HF sampler's
        ``old_logps`` for a loss without a ratio to them; None in a placeholder batch."""
        sampler = batch.get("sampler_logps")
        if sampler is None and not self.ratio_to_old_logps and self.max_staleness >= 1:
            sampler = batch.get("old_logps")
        return sampler

    def importance_weights(
        self,
        batch: dict[str, Any],
        old_logps: Tensor,
        logps: Tensor | None = None,
        advantages: Tensor | None = None,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Detached weights ``[N, C]`` of each token's policy-gradient term, and their metrics;
        ``(None, {})`` when nothing is corrected (:meth:`~grimoire.losses.sampler_correction.
        SamplerCorrection.weights`: the mode's importance weight where :attr:`sampler_differs`,
        times the off-policy sequence mask given ``logps`` and per-completion ``advantages``)."""
        return self.sampler_correction.weights(
            batch["completion_mask"],
            old_logps,
            self.sampler_logps(batch),
            sampler_differs=self.sampler_differs,
            engine_cap=self.engine.sampler.importance_sampling_cap,
            logps=logps,
            advantages=advantages,
        )

    def policy_logps(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, Tensor | None]:
        """``[N, C]`` policy log-probs (with grad, masked) and the detached entropy if logged."""
        return batch_completion_logps(
            model, batch, self.logp_temperature, self.log_entropy, **self._fused_args()
        )

    def _fused_args(self) -> dict[str, Any]:
        return {"fused": self.fused, "chunk_size": self.fused_chunk_size}

    # ------------------------------------------------------------------ loss protocol

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Any]]:
        if is_prompt_batch(batch):  # an evaluation batch of prompts
            raise RuntimeError(
                f"{type(self).__name__}: prompt batches are sampled and scored by the rollout "
                "stage (GrimoireTrainer.rollouts.evaluate), not by the loss"
            )
        return self.compute_loss(model, batch)

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        raise NotImplementedError

    def loss_weight(self, batch: dict[str, Any]) -> float:
        if is_prompt_batch(batch):  # an evaluation batch: one unit per prompt
            return float(num_rows(batch))
        return self.training_loss_weight(batch)

    def training_loss_weight(self, batch: dict[str, Any]) -> float:
        """Default: one unit per sequence with at least one completion token (0 for a batch
        with nothing to train: the trainer then adds its metrics with weight 0)."""
        return float((batch["completion_mask"].sum(-1) > 0).sum())


def full_signature() -> inspect.Signature:
    """:class:`OnlineMethod`'s arguments with its ``**rollout`` spelled out: the rollout's
    settings (:class:`~grimoire.rollout.assembly.RolloutSettings`), keyword-only, after the
    reward functions and before the method's own."""
    own = list(inspect.signature(inspect.unwrap(OnlineMethod.__init__)).parameters.values())[1:]
    head, tail = own[:2], [p for p in own[2:] if p.kind is not p.VAR_KEYWORD]
    settings = [
        p.replace(kind=p.KEYWORD_ONLY)
        for p in inspect.signature(RolloutSettings).parameters.values()
        if p.name not in ("reward_funcs", "reward_weights")
    ]
    return inspect.Signature([*head, *settings, *correction_parameters(), *tail])


def _spell_out_the_rollout_settings() -> None:
    """``help(OnlineMethod)`` and the YAML checks of ``loss.args`` see every setting."""
    init = OnlineMethod.__init__
    first = next(iter(inspect.signature(inspect.unwrap(init)).parameters.values()))  # self
    params = [first, *full_signature().parameters.values()]
    init.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]


_spell_out_the_rollout_settings()

# The contract OnlineMethod implements, with the rollout's own types; checked by the type checker.
_IMPLEMENTS: type[RolloutMethod] = OnlineMethod


__all__ = ["OnlineMethod"]
