"""``OnlineMethod``: the rollout machinery shared by GRPO, RLOO, Online DPO and RAFT.

How an online method plugs into the one training loop (:class:`grimoire.GrimoireTrainer`):

1. The dataset holds prompts (:func:`grimoire.data.grpo.tokenize_grpo`); each micro-batch the
   planner gives this rank is ``batch_size`` prompts (collated by ``GRPOCollator``).
2. ``prepare_step(trainer, micro_batches)`` runs before the optimizer step: for every prompt
   micro-batch it samples ``G = num_generations`` completions per prompt with the rollout engine,
   scores them with the reward functions, and the subclass's :meth:`build_batch` turns that into
   one training micro-batch (advantages, old / reference log-probs, selections). Micro-batch
   count and order are kept, so the trainer's dummy-batch flags stay aligned.
3. The trainer weights each training micro-batch by :meth:`loss_weight` and back-propagates
   :meth:`__call__`'s loss.

Groups are never split: a prompt and its G completions live in one micro-batch on the rank that
owns the prompt, so group statistics (means, stds, leave-one-out baselines, best/worst) are
computed locally and need no communication. ``steps_per_batch > 1`` (GRPO's
``num_iterations``) makes the planner repeat the same prompts for that many optimizer steps;
the rollout of the first is cached and reused by the others (same completions, same old
log-probs), which is exactly PPO's several epochs over one rollout batch.

Rollout metrics (rewards, lengths, timings) ride along in the training batch under
``"rollout_metrics"`` and are returned with the loss's own metrics, so they are averaged over
micro-batches and ranks like every other metric (weighted by the micro-batch's loss units).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ..data.grpo import GRPOCollator, prompt_token_lists
from ..errors import DataError
from ..logprobs import IGNORE_INDEX, compute_token_logps, logps_from_logits
from ..rollout.engine import (
    HFGenerateEngine,
    Rollout,
    RolloutEngine,
    _entropy,
    completion_logps,
)
from ..rollout.rewards import (
    RewardFn,
    RewardFunction,
    resolve_reward_funcs,
    score_completions,
)
from .base import GrimoireLoss
from .online_functional import equal_reward_groups, reward_std
from .preference import is_peft_model, model_dtype

logger = logging.getLogger(__name__)

#: Loss weight of a training micro-batch with nothing to train on (all groups dropped / tied):
#: tiny but > 0, so the trainer still records its metrics. A rank whose every micro-batch had
#: weight 0 would log no metric keys at all and the cross-rank metric all-reduce would hang.
#: Its loss is exactly 0, so the only effect is a relative 1e-9 change of the normaliser.
EMPTY_WEIGHT = 1e-9

#: Batch keys of a prompt micro-batch that are not reward-function columns.
_NOT_COLUMNS = ("prompt_input_ids", "prompt_attention_mask", "prompt")


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class ReferencePolicy:
    """The frozen reference policy ``pi_ref`` of KL-regularised / DPO-style online methods.

    Resolution in :meth:`setup`: an explicit ``ref_model`` (cast to the policy's dtype unless
    quantized, moved to its device, frozen, eval mode); else, when the policy is a peft model,
    the policy itself with its adapters disabled (no extra memory); else a frozen deep copy of the
    policy at the start of training (what "reference = initial policy" means; it doubles the
    model's memory: prefer LoRA or an explicit ``ref_model`` for big models). Offline preference
    losses have the same first two sources in :class:`grimoire.losses.preference.ReferenceLogps`
    (plus cached columns, which cannot exist for freshly sampled completions).
    """

    def __init__(self, ref_model: torch.nn.Module | None = None):
        self.ref_model = ref_model
        self.policy: torch.nn.Module | None = None
        self.mode = "unset"

    def setup(self, policy: torch.nn.Module, device: torch.device) -> None:
        if self.ref_model is not None:
            self.mode = "model"
            ref = self.ref_model
            quantized = getattr(ref, "is_quantized", False) or getattr(ref, "hf_quantizer", None)
            dtype = model_dtype(policy)
            if not quantized:
                # Same precision as the policy, so policy and reference differ by training only.
                ref = ref.to(device=device, dtype=dtype) if dtype else ref.to(device)
        elif is_peft_model(policy):
            self.mode, self.policy = "adapter", policy
            return
        else:
            self.mode = "copy"
            ref = copy.deepcopy(policy).to(device)
        ref.eval().requires_grad_(False)
        self.ref_model = ref

    @contextmanager
    def model(self) -> Iterator[torch.nn.Module]:
        """The reference as a model, in eval mode, for a no-grad forward."""
        if self.mode == "adapter":
            assert self.policy is not None
            with self.policy.disable_adapter(), _eval_mode(self.policy):
                yield self.policy
        elif self.ref_model is not None:
            yield self.ref_model
        else:
            raise RuntimeError("ReferencePolicy.setup() was not called")


class OnlineMethod(GrimoireLoss):
    """Base class of the online methods; see the module docstring for the flow.

    Args:
        reward_funcs: reward callables, built-in names (``"exact_match"``, ``"char_match"``) or
            ``package.module:function`` specs (importing a spec runs its module's code).
        reward_weights: one weight per reward function (default 1.0 each).
        num_generations: completions sampled per prompt (``G``).
        temperature, top_p, top_k, max_new_tokens: sampling (``top_k=0``, ``top_p=1``: off).
        beta: KL / reference strength (meaning per method); ``0`` loads no reference model.
        ref_model: an explicit reference model (default: see :class:`ReferencePolicy`).
        generation_batch_size: max sequences per sampling / scoring call (memory only).
        engine: a custom :class:`RolloutEngine` (e.g. a vLLM backend) replacing the HF one; its
            own ``temperature`` / ``max_new_tokens`` then override the arguments above.
        log_entropy: compute the policy's token entropy as a metric (one extra softmax).
    """

    needs_generation = True
    required_columns = ("prompt_input_ids", "prompt_attention_mask", "prompt")
    #: Smallest G the method accepts (groups need >= 2 to compare completions).
    min_generations = 2

    def __init__(
        self,
        reward_funcs: RewardFn | str | Sequence[RewardFn | str],
        reward_weights: Sequence[float] | None = None,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 256,
        beta: float = 0.0,
        ref_model: torch.nn.Module | None = None,
        generation_batch_size: int | None = None,
        engine: RolloutEngine | None = None,
        log_entropy: bool = True,
    ):
        name = type(self).__name__
        if not isinstance(num_generations, int) or num_generations < self.min_generations:
            raise ValueError(
                f"{name}: num_generations must be an int >= {self.min_generations} (the method "
                f"compares completions within a group), got {num_generations!r}"
            )
        if beta < 0:
            raise ValueError(f"{name}: beta must be >= 0, got {beta}")
        self.reward_funcs: list[RewardFunction] = resolve_reward_funcs(reward_funcs, reward_weights)
        if engine is not None:  # the engine samples, so its settings are the ones that hold
            temperature, max_new_tokens = engine.temperature, engine.max_new_tokens
        self.num_generations = num_generations
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.beta = beta
        self.engine = engine or HFGenerateEngine(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generation_batch_size=generation_batch_size,
        )
        self.reference = ReferencePolicy(ref_model)
        self.log_entropy = log_entropy
        self.tokenizer: Any = None
        self.accelerator: Any = None
        self._cache: tuple[tuple[int, int], list[dict[str, Any]]] | None = None
        #: Emit padding-free (packed) TRAINING micro-batches; set by :meth:`setup` from the
        #: trainer's ``padding_free`` / ``max_tokens_per_device`` (generation stays padded).
        self.pack_training = False
        self._last_step_start: float | None = None

    # ------------------------------------------------------------------ capabilities

    @property
    def needs_reference_model(self) -> bool:  # type: ignore[override]
        return self.beta > 0

    #: Optimizer steps per rollout batch (GRPO's num_iterations); read by the trainer's planner.
    steps_per_batch: int = 1

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
        prompts); padding-free applies to the training micro-batches ``prepare_step`` builds."""
        return GRPOCollator(pad_token_id=pad_token_id)

    # ------------------------------------------------------------------ token budget

    def budget_tokens(self, lengths: dict[str, int], packed: bool) -> int:
        """A prompt's unit is its group: ``G`` sequences of prompt + up to ``max_new_tokens``.

        Bounds every pass the prompt takes part in: sampling (``G`` rows whose KV cache grows to
        prompt + max_new_tokens), old-policy / reference / policy passes over the packed rollout.
        """
        return self.num_generations * (lengths["prompt_"] + self.max_new_tokens)

    @property
    def budget_hint(self) -> str:
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
        names = set(
            getattr(dataset, "column_names", None) or (dataset[0].keys() if len(dataset) else [])
        )
        for rf in self.reward_funcs:
            missing = [c for c in rf.required_columns() if c not in names]
            if missing:
                problems.append(
                    f"{split} dataset: reward function {rf.name!r} needs column(s) {missing}; the "
                    f"dataset has {sorted(names)} (tokenize_grpo keeps a row's extra columns)"
                )
        return problems

    def setup(self, trainer: Any) -> None:
        """Bind the rollout engine to the policy, check prompt lengths, load the reference."""
        self.accelerator = trainer.accelerator
        self.tokenizer = trainer.tokenizer
        policy = trainer.unwrapped_model
        tok = trainer.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            eos = getattr(getattr(policy, "config", None), "eos_token_id", None)
        pad = getattr(tok, "pad_token_id", None)
        pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
        self.engine.bind(policy, pad, eos, trainer.accelerator.autocast)
        self.engine.max_tokens = trainer.config.max_tokens_per_device
        self._check_lengths(trainer, policy)
        cfg = trainer.config
        self.pack_training = bool(
            getattr(cfg, "padding_free", False) or getattr(cfg, "max_tokens_per_device", None)
        )
        if self.needs_reference_model:
            self.reference.setup(policy, trainer.accelerator.device)
        dropout = [m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if dropout and not trainer.config.disable_dropout:
            logger.warning(
                "%s: the model has dropout (p=%s); set training.disable_dropout=True so the "
                "log-probs of sampling and training agree",
                type(self).__name__,
                dropout[0],
            )

    def _check_lengths(self, trainer: Any, policy: torch.nn.Module) -> None:
        limit = trainer.config.max_length
        where = "training.max_length"
        max_pos = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        if isinstance(max_pos, int) and max_pos < limit:
            limit, where = max_pos, "the model's max_position_embeddings"
        problems = []
        for split, ds in (("train", trainer.train_dataset), ("eval", trainer.eval_dataset)):
            if ds is None:
                continue
            ids = (
                ds["prompt_input_ids"]
                if hasattr(ds, "column_names")
                else [r["prompt_input_ids"] for r in ds]
            )
            for i, row in enumerate(ids):
                if len(row) + self.max_new_tokens > limit:
                    problems.append(
                        f"{split} row {i}: prompt of {len(row)} tokens + max_new_tokens="
                        f"{self.max_new_tokens} > {limit} ({where}); shorten the prompt, lower "
                        "max_new_tokens or raise the limit"
                    )
        if problems:
            shown = problems[:20] + (
                [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
            )
            raise DataError(shown, title="prompts do not fit the context (nothing was trained)")

    # ------------------------------------------------------------------ the rollout phase

    def prepare_step(self, trainer: Any, micro_batches: list[dict[str, Any]]) -> list[dict]:
        """Generate, score and build this step's training micro-batches (one per input)."""
        now = time.perf_counter()
        timing: dict[str, float] = {}
        if self._last_step_start is not None:
            timing["time/step"] = now - self._last_step_start  # the previous step, end to end
        self._last_step_start = now
        key = (trainer.state.epoch, trainer.state.step_in_epoch // max(1, self.steps_per_batch))
        if self.steps_per_batch > 1 and self._cache is not None and self._cache[0] == key:
            timing.update({"time/generation": 0.0, "time/rollout": 0.0})
            return [_with_metrics(b, timing) for b in self._cache[1]]

        self.engine.sync_weights()
        rollouts = []
        for mb in micro_batches:
            rollouts.append(
                self.engine.generate(
                    prompt_token_lists(mb),
                    self.num_generations,
                    with_old_logps=self.needs_old_logps,
                )
            )
        t_gen = time.perf_counter() - now
        scored = [self._score(mb, r) for mb, r in zip(micro_batches, rollouts)]
        batches = self.build_batches(trainer, micro_batches, rollouts, scored)
        timing.update({"time/generation": t_gen, "time/rollout": time.perf_counter() - now})
        batches = [_with_metrics(b, timing) for b in batches]
        if self.steps_per_batch > 1:
            self._cache = (key, batches)
        return batches

    def _score(self, mb: dict[str, Any], rollout: Rollout) -> dict[str, Any]:
        """Decode completions, run the reward functions; returns rewards + rollout metrics."""
        g = rollout.group_size
        texts = self.decode(rollout)
        prompts = [p for p in mb["prompt"] for _ in range(g)]
        columns = {
            k: [v for v in values for _ in range(g)]
            for k, values in mb.items()
            if k not in _NOT_COLUMNS and isinstance(values, list)
        }
        device = rollout.completion_ids.device
        total, per_func = score_completions(self.reward_funcs, prompts, texts, columns, device)
        lengths = rollout.completion_mask.sum(-1).float()
        metrics = {
            "rewards/mean": float(total.mean()),
            "rewards/std": reward_std(total.tolist()),
            "completions/mean_length": float(lengths.mean()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(rollout.truncated.float().mean()),
            "frac_reward_zero_std": float(equal_reward_groups(total, g).float().mean()),
        }
        for name, r in per_func.items():
            metrics[f"rewards/{name}/mean"] = float(r.mean())
            metrics[f"rewards/{name}/std"] = reward_std(r.tolist())
        return {"rewards": total, "per_func": per_func, "metrics": metrics, "texts": texts}

    def decode(self, rollout: Rollout) -> list[str]:
        """Completion texts (special tokens, e.g. EOS, skipped)."""
        rows = [
            ids[m.bool()].tolist()
            for ids, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())
        ]
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))

    def build_batches(
        self,
        trainer: Any,
        micro_batches: list[dict[str, Any]],
        rollouts: list[Rollout],
        scored: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """Default: :meth:`build_batch` per micro-batch. Override for step-level statistics."""
        return [self.build_batch(r, s) for r, s in zip(rollouts, scored)]

    def build_batch(self, rollout: Rollout, scored: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared tensor helpers

    def rollout_batch(
        self, rollout: Rollout, rows: Sequence[int], scored: dict[str, Any]
    ) -> dict[str, Any]:
        """A training batch of ``rows`` of ``rollout`` (completion width trimmed to fit).

        No rows -> one placeholder row with an all-zero ``completion_mask`` (loss 0, loss weight
        0), because every rank must still run a forward/backward for DDP to stay in step.
        """
        keep = list(rows) or [0]
        idx = torch.tensor(keep, device=rollout.completion_ids.device)
        cmask = rollout.completion_mask[idx]
        if not rows:
            cmask = torch.zeros_like(cmask)
        width = max(1, int(rollout.completion_mask[idx].sum(-1).max()))
        batch = {
            "input_ids": torch.cat(
                [rollout.prompt_ids[idx], rollout.completion_ids[idx, :width]], dim=1
            ),
            "attention_mask": torch.cat(
                [rollout.prompt_mask[idx], rollout.completion_mask[idx, :width]], dim=1
            ),
            "completion_mask": cmask[:, :width],
            "rollout_metrics": dict(scored["metrics"]),
        }
        if rollout.old_logps is not None:
            batch["old_logps"] = rollout.old_logps[idx, :width]
        return pack_rollout_batch(batch) if self.pack_training else batch

    @torch.no_grad()
    def reference_logps(self, batch: dict[str, Any]) -> Tensor:
        """``[N, C]`` reference log-probs of a training batch's completions (masked)."""
        c = batch["completion_mask"].shape[1]
        with self.reference.model() as ref, self.accelerator.autocast():
            if "seq_lens" in batch:
                logps, _ = packed_completion_logps(ref, batch, self.logp_temperature)
            else:
                logps, _ = completion_logps(
                    ref, batch["input_ids"], batch["attention_mask"], c, self.logp_temperature
                )
        return logps * batch["completion_mask"]

    def policy_logps(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, Tensor | None]:
        """``[N, C]`` policy log-probs (with grad) and the detached entropy (if logged)."""
        if "seq_lens" in batch:
            logps, entropy = packed_completion_logps(
                model, batch, self.logp_temperature, with_entropy=self.log_entropy
            )
            return logps * batch["completion_mask"], entropy
        c = batch["completion_mask"].shape[1]
        logps, entropy = completion_logps(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            c,
            self.logp_temperature,
            with_entropy=self.log_entropy,
        )
        return logps * batch["completion_mask"], entropy

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum floats over ranks (identity on one process)."""
        acc = self.accelerator
        if acc is None or acc.num_processes == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=acc.device)
        return acc.reduce(t, reduction="sum").tolist()

    # ------------------------------------------------------------------ loss protocol

    def __call__(
        self, model: torch.nn.Module, batch: dict[str, Any], training: bool = True
    ) -> tuple[Tensor, dict[str, Any]]:
        if "completion_mask" not in batch:
            return self.evaluate_prompts(model, batch)
        loss, metrics = self.compute_loss(model, batch)
        return loss, {**metrics, **batch.get("rollout_metrics", {})}

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        raise NotImplementedError

    def loss_weight(self, batch: dict[str, Any]) -> float:
        if "completion_mask" not in batch:  # an evaluation batch of prompts
            return float(batch["prompt_input_ids"].shape[0])
        return max(self.training_loss_weight(batch), EMPTY_WEIGHT)

    def training_loss_weight(self, batch: dict[str, Any]) -> float:
        """Default: one unit per sequence with at least one completion token."""
        return float((batch["completion_mask"].sum(-1) > 0).sum())

    @torch.no_grad()
    def evaluate_prompts(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        """Evaluation: one GREEDY completion per prompt, scored by the reward functions.

        ``eval/loss`` is minus the mean total reward (lower is better, like a loss); the per
        function means are logged as ``eval/rewards/<name>/mean``.
        """
        rollout = self.engine.generate(
            prompt_token_lists(batch), 1, with_old_logps=False, greedy=True
        )
        scored = self._score(batch, rollout)
        metrics = {k: v for k, v in scored["metrics"].items() if not k.endswith("/std")}
        metrics.pop("frac_reward_zero_std", None)
        return -scored["rewards"].mean(), metrics


def pack_rollout_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A padded training batch (``[N, P + C]`` rows: left-padded prompt, right-padded completion)
    as ONE packed row of its ``N`` real prompt+completion samples.

    Only ``input_ids`` / ``attention_mask`` change (to ``input_ids``, ``labels``,
    ``position_ids``, ``seq_lens``, ``sample_index`` as from
    :func:`grimoire.data.packing.pack_samples`); the per-token tensors (``completion_mask``,
    ``old_logps``, advantages, reference log-probs) keep their padded ``[N, C]`` completion
    layout, and ``completion_index [N, C]`` (each completion token's position in the packed row,
    -1 on padding) lets :func:`packed_completion_logps` return log-probs in that same layout, so
    the loss code is shared. Positions restart at 0 per sample: exactly the padded path's
    ``cumsum(attention_mask) - 1`` at real tokens.
    """
    keep = batch["attention_mask"].bool()
    c = batch["completion_mask"].shape[1]
    device = keep.device
    ids = batch["input_ids"][keep]  # row-major: the samples back to back
    lens = keep.sum(-1)
    where = torch.full(keep.shape, -1, dtype=torch.long, device=device)
    where[keep] = torch.arange(ids.numel(), device=device)
    is_completion = torch.zeros_like(keep)
    is_completion[:, -c:] = True
    labels = batch["input_ids"].masked_fill(~is_completion, IGNORE_INDEX)[keep]
    sample_index = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    position_ids = torch.arange(ids.numel(), device=device) - starts[sample_index]
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    out.update(
        input_ids=ids[None],
        labels=labels[None],
        position_ids=position_ids[None],
        seq_lens=lens,
        sample_index=sample_index[None],
        completion_index=where[:, -c:],
    )
    return out


def packed_completion_logps(
    model: torch.nn.Module, batch: dict[str, Any], temperature: float, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """:func:`~grimoire.rollout.engine.completion_logps` for a :func:`pack_rollout_batch` batch:
    ``[N, C]`` completion log-probs (0 on padding) and the detached entropy, same layout."""
    index = batch["completion_index"]
    valid = index >= 0
    # A completion token is predicted from the position before it (always the same sample's:
    # the prompt comes first), so gather from there.
    src = (index - 1).clamp(min=0)
    ids, pos = batch["input_ids"], batch["position_ids"]
    if temperature == 1.0:
        out = compute_token_logps(
            model, ids, batch["labels"], position_ids=pos, return_entropy=with_entropy
        )
        logps = out.logps[0][src]
        entropy = out.entropy[0][src].detach() if with_entropy else None
    else:
        # No logits_to_keep: completions are spread along the row, so the head runs on it all.
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        logits = logits[src] / temperature  # [N, C, V]
        logps = logps_from_logits(logits, ids[0][index.clamp(min=0)])
        entropy = _entropy(logits.detach()) if with_entropy else None
    return logps.masked_fill(~valid, 0.0), entropy


def _with_metrics(batch: dict[str, Any], extra: dict[str, float]) -> dict[str, Any]:
    return {**batch, "rollout_metrics": {**batch["rollout_metrics"], **extra}}


__all__ = [
    "OnlineMethod",
    "ReferencePolicy",
    "pack_rollout_batch",
    "packed_completion_logps",
]
