"""On-policy distillation: the student samples, a frozen teacher scores every sampled token.

Papers: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD), arXiv 2306.13649; Thinking Machines Lab, "On-Policy Distillation" (2025); as
TRL's ``GKDTrainer`` (``lmbda = 1``: always on-policy) and its on-policy distillation recipe.

Flow (the same rollout stage as GRPO, :mod:`grimoire.losses.online`): per prompt the student
samples ``G = num_generations`` completions with the run's engine (HF, or either vLLM engine);
the teacher is held as this method's :class:`~grimoire.forward.reference.Reference` (frozen, eval
mode, the policy's dtype and device) and gives log-probs of the sampled tokens through the shared
head path (:func:`grimoire.forward.completions.batch_completion_logps`, fused at temperature 1).
No reward is needed; ``reward_funcs`` given here are only scored and logged (e.g. held-out
``eval/rewards/exact_match/mean``), never trained on.

Objectives (``loss_type``):

- ``"reverse_kl"`` (default): per-token reverse KL on the sampled tokens with a policy-gradient
  estimator, :func:`~grimoire.losses.distill_functional.sampled_reverse_kl_loss`.
- ``"jsd"``: GKD's generalised JSD over the full vocabulary with ``beta`` in [0, 1] (0: forward
  KL, 1: reverse KL), :func:`~grimoire.losses.distill_functional.chunked_generalized_jsd`. Both
  models' logits over the micro-batch's completion tokens are materialised (``[tokens, V]`` each,
  the student's kept for backward); the divergence itself is computed ``jsd_chunk_size`` rows at
  a time.

Log-probs / logits are at the sampling temperature for both models (as TRL's GKD). Loss weight:
completion tokens, so the trainer's normalisation gives the token mean over the global batch.
Metrics: ``distill/reverse_kl`` (mean per token of ``log pi_s(y_t) - log pi_t(y_t)`` on the
sampled tokens, in both modes), ``distill/teacher_logp``, and ``distill/jsd`` with ``"jsd"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from grimoire.config.context import TrainingContext
from grimoire.errors import ConfigError
from grimoire.forward.batch import layout_token_logps
from grimoire.forward.completions import completion_rows
from grimoire.forward.logprobs import logps_from_logits
from grimoire.forward.reference import Reference, unwrap
from grimoire.losses.distill_functional import chunked_generalized_jsd, sampled_reverse_kl_loss
from grimoire.losses.online import OnlineMethod
from grimoire.rollout.rewards.calls import RewardSpec
from grimoire.rollout.stage import ScoredGroup
from grimoire.rows.sources import resolve_path

LOSS_TYPES = ("reverse_kl", "jsd")
#: Where the teacher is named in a YAML config (for messages).
TEACHER_KEY = "loss.args.teacher"


def load_teacher(name_or_path: str) -> tuple[torch.nn.Module, dict[str, int] | None]:
    """A causal LM from a folder, ``grimoire://REL`` or a hub name (``trust_remote_code=False``),
    and its tokenizer's vocabulary when it has one (for the compatibility check)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(resolve_path(name_or_path))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        local = "" if Path(path).exists() else " (no such folder)"
        raise ValueError(
            f"{TEACHER_KEY}: cannot load the teacher {name_or_path!r}{local}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0]}; give a folder with config.json "
            "and weights, grimoire://<bundled model> or a hub name (offline: already cached)"
        ) from exc
    try:
        vocab = AutoTokenizer.from_pretrained(path, trust_remote_code=False).get_vocab()
    except (OSError, ValueError):
        vocab = None  # a model folder without a tokenizer: the head size is still checked
    return model, vocab


def _head_rows(model: torch.nn.Module) -> int | None:
    head = getattr(unwrap(model), "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def completion_logits(model: torch.nn.Module, batch: dict[str, Any], temperature: float) -> Tensor:
    """``[M, V]`` logits (divided by ``temperature``) that predicted the batch's ``M`` real
    completion tokens, in the row-major order of ``completion_mask``; padded or packed batches.

    One forward through :func:`grimoire.forward.batch.layout_token_logps` (the one dispatch on
    the layout) on :func:`grimoire.forward.completions.completion_rows`; the head runs on the last
    ``C + 1`` positions of padded rows (completions are right-aligned after the left-padded
    prompts) and on all of a packed row. Completion token ``t`` of row ``i`` is predicted from
    the position before it, ``completion_index[i, t] - 1`` of the forward's flattened output."""
    c = batch["completion_mask"].shape[1]

    def compute(ids, labels, attention_mask, position_ids, layout) -> Tensor:
        # Padded rows come with their mask (a packed row without: its samples lie along it).
        window = c + 1 if attention_mask is not None else 0
        return model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=window,
        ).logits  # [R, K, V]: each row's last K positions

    rows, index = completion_rows(batch)
    inputs = (rows.input_ids, rows.labels, rows.layout, rows.attention_mask, rows.position_ids)
    logits = layout_token_logps(compute, *inputs)
    width, kept = rows.input_ids.shape[1], logits.shape[1]
    src = _completion_positions(batch, index) - 1
    src = (src // width) * kept + src % width - (width - kept)  # into the kept window
    return logits.reshape(-1, logits.shape[-1])[src] / temperature


def _completion_positions(batch: dict[str, Any], index: Tensor) -> Tensor:
    """``[M]`` the real completion tokens' flattened positions in the forward's input."""
    return index[batch["completion_mask"].bool() & (index >= 0)]


def completion_targets(batch: dict[str, Any]) -> Tensor:
    """``[M]`` the real completion tokens, in :func:`completion_logits`' order."""
    rows, index = completion_rows(batch)
    return rows.input_ids.reshape(-1)[_completion_positions(batch, index)]


class DistillMethod(OnlineMethod):
    """On-policy distillation from ``teacher`` (see the module docstring).

    Args:
        teacher: the teacher, a causal LM sharing the student's tokenizer: a model, or a folder /
            ``grimoire://REL`` / hub name loaded here with ``trust_remote_code=False``. Frozen,
            eval mode, cast to the policy's dtype and placed on its device at set-up. A GGUF
            file is a model source the CLI resolves (:attr:`model_args`) like
            ``model.pretrained``; from Python pass ``grimoire.resolve_pretrained(path)``.
        loss_type: ``"reverse_kl"`` (sampled tokens, policy gradient) or ``"jsd"`` (GKD).
        beta: the generalised JSD's interpolation with ``loss_type="jsd"`` (0 forward KL,
            1 reverse KL; TRL's default 0.5).
        reward_funcs, reward_weights: optional, logged only (rollout and eval rewards).
        jsd_chunk_size: rows per chunk of the full-vocabulary divergence.
        num_generations: completions per prompt (1 is enough: no group baseline is used).
    """

    min_generations = 1
    #: The teacher is the reference; no per-completion advantage for the off-policy mask.
    hidden_args = ("ref_model", "off_policy_mask_threshold")
    #: Arguments that name a model: the CLI resolves them as it does ``model.pretrained``
    #: (a ``.gguf`` file or ``grimoire://models/<name>`` becomes its cached folder).
    model_args = ("teacher",)

    def __init__(
        self,
        teacher: torch.nn.Module | str,
        loss_type: str = "reverse_kl",
        beta: float = 0.5,
        reward_funcs: RewardSpec | Sequence[RewardSpec] | None = None,
        reward_weights: Sequence[float] | None = None,
        jsd_chunk_size: int = 1024,
        num_generations: int = 1,
        log_entropy: bool = False,
        **kwargs: Any,
    ):
        if "ref_model" in kwargs:
            raise TypeError(
                "DistillMethod: the teacher is its reference; give teacher=, not ref_model="
            )
        if loss_type not in LOSS_TYPES:
            raise ValueError(
                f"DistillMethod: loss_type must be one of {LOSS_TYPES}, got {loss_type!r}"
            )
        if not isinstance(beta, int | float) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"DistillMethod: beta must be in [0, 1] (GKD's JSD), got {beta!r}")
        if not reward_funcs and reward_weights is not None:
            raise ValueError("DistillMethod: reward_weights given without reward_funcs")
        if not isinstance(jsd_chunk_size, int) or jsd_chunk_size < 1:
            raise ValueError(
                f"DistillMethod: jsd_chunk_size must be an int >= 1, got {jsd_chunk_size!r}"
            )
        if not isinstance(teacher, str | torch.nn.Module):
            raise ValueError(
                f"DistillMethod: teacher must be a model or a path / hub name ({TEACHER_KEY}), "
                f"got {type(teacher).__name__}"
            )
        # The base needs one reward function to resolve; none given -> none scored.
        super().__init__(
            reward_funcs or "exact_match",
            reward_weights,
            num_generations=num_generations,
            log_entropy=log_entropy,
            **kwargs,
        )
        if not reward_funcs:
            self.reward_funcs = []
        self.loss_type = loss_type
        self.beta = float(beta)  # the JSD's (the base's KL strength has no meaning here)
        self.jsd_chunk_size = jsd_chunk_size
        self.teacher_vocab: dict[str, int] | None = None
        if isinstance(teacher, str):  # loaded last: every cheap argument check has passed
            teacher, self.teacher_vocab = load_teacher(teacher)
        self.teacher = self.reference = Reference(teacher, "DistillMethod (teacher)")

    @property
    def needs_reference_model(self) -> bool:  # type: ignore[override]
        # The rollout stage scores the sampled tokens with the teacher for the reverse KL; the
        # JSD needs the teacher's logits, taken in compute_loss instead.
        return self.loss_type == "reverse_kl"

    def setup(self, ctx: TrainingContext) -> None:
        self._check_vocab(ctx)
        super().setup(ctx)
        if not self.needs_reference_model:
            self.teacher.setup(ctx)

    def _check_vocab(self, ctx: TrainingContext) -> None:
        teacher = cast(torch.nn.Module, self.teacher.ref_model)  # __init__ loaded a path
        problems = []
        rows, student_rows = _head_rows(teacher), _head_rows(ctx.unwrapped_model)
        if rows is not None and student_rows is not None and rows != student_rows:
            problems.append(
                f"{TEACHER_KEY}: the teacher's output layer has {rows} tokens, the student's "
                f"{student_rows}; distillation compares distributions over one shared vocabulary "
                "(give a teacher that shares the student's tokenizer)"
            )
        n_tok = len(ctx.tokenizer) if ctx.tokenizer is not None else None
        if rows is not None and n_tok is not None and n_tok > rows:
            problems.append(
                f"{TEACHER_KEY}: the tokenizer has {n_tok} tokens but the teacher's output layer "
                f"only {rows}"
            )
        vocab = ctx.tokenizer.get_vocab() if ctx.tokenizer is not None else None
        if self.teacher_vocab is not None and vocab is not None and self.teacher_vocab != vocab:
            problems.append(
                f"{TEACHER_KEY}: the teacher's tokenizer differs from the student's (the same "
                "token ids must mean the same strings)"
            )
        if problems:
            raise ConfigError(problems)

    def build_batch(self, group: ScoredGroup) -> tuple[dict[str, Any], dict[str, float]]:
        rows = range(group.rewards.numel())  # every sample trains: no selection, no baseline
        return self.training_batch(group, rows), {}

    @torch.no_grad()
    def teacher_logits(self, batch: dict[str, Any]) -> Tensor:
        ctx = self.context
        with self.teacher.model(ctx.unwrapped_model) as teacher, ctx.accelerator.autocast():
            return completion_logits(teacher, batch, self.logp_temperature)

    def compute_loss(
        self, model: torch.nn.Module, batch: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Any]]:
        mask = batch["completion_mask"]
        n_tokens = mask.sum().clamp(min=1)
        metrics: dict[str, Any] = {"num_loss_tokens": mask.sum().float()}
        if self.loss_type == "reverse_kl":
            logps, entropy = self.policy_logps(model, batch)
            weights, is_metrics = self.importance_weights(batch, logps.detach())
            teacher = batch["ref_logps"]
            loss_sum, k = sampled_reverse_kl_loss(logps, teacher, mask, weights)
            metrics.update(is_metrics)
            metrics["distill/teacher_logp"] = (teacher * mask).sum() / n_tokens
            if entropy is not None:
                metrics["entropy"] = (entropy * mask).sum() / n_tokens
        else:
            student = completion_logits(model, batch, self.logp_temperature)
            teacher = self.teacher_logits(batch)
            targets = completion_targets(batch)
            jsd = chunked_generalized_jsd(student, teacher, self.beta, self.jsd_chunk_size)
            loss_sum = jsd.sum()
            t_logps = logps_from_logits(teacher, targets)
            k = logps_from_logits(student.detach(), targets) - t_logps
            metrics["distill/jsd"] = jsd.detach().sum() / n_tokens
            metrics["distill/teacher_logp"] = t_logps.sum() / n_tokens
        metrics["distill/reverse_kl"] = k.sum() / n_tokens
        return loss_sum / n_tokens, metrics

    def training_loss_weight(self, batch: dict[str, Any]) -> float:
        return float(batch["completion_mask"].sum())


__all__ = ["DistillMethod", "completion_logits", "completion_targets", "load_teacher"]
