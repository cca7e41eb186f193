"""Pure math of the offline preference methods, on already-reduced sequence log-probs.

Every loss here takes per-example log-probs (``[B]``; the caller has already summed or averaged
the per-token log-probs, see :class:`grimoire.forward.logprobs.TokenLogps`) and returns
``(losses, metrics)``:

- ``losses``: ``[B]`` float32, one loss per example (per pair for pairwise methods). The caller
  reduces it (usually ``.mean()``), so micro-batch weighting stays the trainer's business.
- ``metrics``: ``dict[str, Tensor]``, all detached. Pairwise methods return *per-example* ``[B]``
  tensors (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
  ``logps/chosen``, ``logps/rejected``) so the caller can weight/gather them exactly like the loss.

KTO's math (sums and counts instead of per-example metrics) is in
:mod:`grimoire.losses.kto_functional` and re-exported here; the input checks every method shares
are in :mod:`grimoire.losses.checks`.

All math runs in float32 whatever the input dtype: bf16 has ~3 significant digits, and the
differences of sequence log-probs (``-300.1 - (-300.4)``) that every method is built on would be
mostly rounding noise. Gradients still flow back to the input dtype through the cast.

Metric names and reward definitions follow TRL's trainers so dashboards are comparable; the
reduction each method expects (sum vs length-average) is in each docstring and in
``docs/losses.md``; for the ``loss_type`` families it is :func:`default_logp_reduction`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from grimoire.losses.checks import (
    Metrics,
    _check_label_smoothing,
    _check_loss_type,
    _check_shapes,
    _check_weight,
    _checked_f32,
    _f32,
)
from grimoire.losses.kto_functional import kto_kl_estimate, kto_loss

__all__ = [
    "DPO_LOSS_TYPES",
    "bradley_terry_loss",
    "cpo_loss",
    "cpo_total_loss",
    "default_logp_reduction",
    "dpo_loss",
    "ipo_loss",
    "kto_kl_estimate",
    "kto_loss",
    "log1mexp",
    "orpo_loss",
    "simpo_loss",
]

#: ``loss_type`` values accepted by :func:`dpo_loss`.
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo", "robust")
#: ``loss_type`` values accepted by :func:`cpo_loss` (TRL's CPO set minus "simpo", which is
#: :func:`simpo_loss`).
CPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo")

#: ORPO clamps ``log p`` to at most this before ``log(1 - p)``: an average log-prob of exactly 0
#: (every token predicted with float32 probability 1) would make ``log(1 - p) = -inf``; the bound
#: also caps ``|d log(1-p) / d log p| = p / (1 - p)`` at ~1e6.
ORPO_MAX_AVG_LOGP: float = -1e-6

_LN2 = math.log(2.0)


def default_logp_reduction(loss_type: str) -> str:
    """The sequence log-prob reduction (``"sum"`` or ``"mean"``) a ``loss_type`` uses by default.

    The one place that decides it, for :class:`~grimoire.losses.dpo.DPOLoss`,
    :class:`~grimoire.losses.ipo.IPOLoss` and :class:`~grimoire.losses.cpo.CPOLoss` alike, so
    ``IPOLoss()`` and ``DPOLoss(loss_type="ipo")`` compute the same loss. TRL 1.16's convention:
    SUMS (the sequence log-likelihoods the papers derive with) for every loss type except
    ``"ipo"``, which takes per-token AVERAGES (``TokenLogps.mean()``), in TRL's DPO and CPO
    trainers alike.

    Why IPO averages: the IPO paper (Azar et al., arXiv 2310.12036) writes ``h`` with sums, but
    unlike DPO's sigmoid its squared loss never saturates, so with sums ``h`` scales with response
    length (tens to hundreds of nats) while the target ``1/(2 beta)`` does not; the fixed target
    then means different things for short and long pairs and the gradient ``2 (h - target)``
    grows with length. Averages keep ``h`` O(1) and comparable across lengths (TRL's DPOTrainer
    notes that the IPO authors confirmed the paper's results use this normalised form). Pass
    ``logp_reduction="sum"`` for the paper-exact formula, with ``beta`` re-tuned for it.
    """
    return "mean" if loss_type == "ipo" else "sum"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def log1mexp(x: Tensor) -> Tensor:
    """Numerically stable ``log(1 - exp(x))`` for ``x < 0``.

    Reference: M. Mächler, "Accurately Computing log(1 - exp(-|a|))" (Rmpfr vignette, 2012; no
    arXiv id). Formula::

        log1mexp(x) = log(-expm1(x))      if x > -ln 2   (1 - e^x is tiny: expm1 keeps digits)
                      log1p(-exp(x))      otherwise       (e^x is tiny: log1p keeps digits)

    Shapes: any -> same shape. Half-precision inputs are promoted to float32; float32/float64 are
    kept. ``x == 0`` gives ``-inf`` and ``x > 0`` gives NaN (``1 - e^x <= 0``): callers with
    log-probabilities that may round to 0 must clamp first (see :func:`orpo_loss`).
    """
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    near_zero = x > -_LN2
    # Each branch is evaluated on an input that is safe *for that branch*: torch.where
    # back-propagates through both, and an inf in the unused one would become 0 * inf = NaN.
    x_near = torch.where(near_zero, x, -_LN2)
    x_far = torch.where(near_zero, -_LN2, x)
    return torch.where(near_zero, torch.log(-torch.expm1(x_near)), torch.log1p(-torch.exp(x_far)))


def _smoothed_sigmoid_loss(logits: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) log sigma(z) - eps log sigma(-z)``: BCE against the soft label ``1 - eps``."""
    losses = -F.logsigmoid(logits)
    if label_smoothing > 0:
        # Skip the second term at eps = 0 so the common case costs one logsigmoid.
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-logits)
    return losses


def _pairwise_metrics(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    chosen_logps: Tensor | None = None,
    rejected_logps: Tensor | None = None,
) -> Metrics:
    chosen_rewards = chosen_rewards.detach()
    rejected_rewards = rejected_rewards.detach()
    metrics: Metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": chosen_rewards - rejected_rewards,
        # Strict '>' as TRL: a tie (e.g. identical policy and reference at step 0) is not a win.
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
    }
    if chosen_logps is not None and rejected_logps is not None:
        metrics["logps/chosen"] = chosen_logps.detach()
        metrics["logps/rejected"] = rejected_logps.detach()
    return metrics


def _pairwise_loss(h: Tensor, beta: float, label_smoothing: float, loss_type: str) -> Tensor:
    """The loss family shared by DPO (``h`` = log-ratio difference) and CPO (``h = c - r``)."""
    logits = beta * h
    if loss_type == "sigmoid":
        return _smoothed_sigmoid_loss(logits, label_smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - logits)
    if loss_type == "ipo":
        # Regress h onto 1/(2 beta); beta plays the role of IPO's regulariser tau.
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        eps = label_smoothing
        # The +eps term (not -eps as in cDPO) makes the loss an unbiased estimate of the clean-label
        # loss under label-flip rate eps (rDPO).
        return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    raise AssertionError(loss_type)  # unreachable: validated by _check_loss_type


# --------------------------------------------------------------------------------------------
# DPO family
# --------------------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, Metrics]:
    r"""DPO and its drop-in variants, from summed sequence log-probs.

    Paper: Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a
    Reward Model", arXiv 2305.18290. With ``h = (pc - rc) - (pr - rr)`` (policy/reference
    log-ratio of chosen minus that of rejected) and ``z = beta * h``:

    - ``"sigmoid"`` (DPO eq. 7; with ``eps = label_smoothing > 0`` conservative DPO / cDPO,
      Mitchell 2023 note "A note on DPO with noisy preferences & relationship to IPO"):
      ``-(1 - eps) log sigma(z) - eps log sigma(-z)``.
    - ``"hinge"`` (SLiC-HF, Zhao et al. 2023, arXiv 2305.10425, as TRL): ``relu(1 - z)``.
    - ``"ipo"`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
      Human Preferences", arXiv 2310.12036): ``(h - 1 / (2 beta))^2``; pass AVERAGED log-probs
      for it (see :func:`default_logp_reduction`).
    - ``"robust"`` (rDPO, Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models
      with Noisy Feedback", arXiv 2403.00409): ``(-(1 - eps) log sigma(z) + eps log sigma(-z))
      / (1 - 2 eps)``.

    DPO's derivation is over sequence likelihoods, so pass SUMMED log-probs (TRL's default) for
    every loss type but ``"ipo"``.
    ``h`` is evaluated as ``(pc - pr) - (rc - rr)``; TRL 1.16 groups it as ``(pc - rc) - (pr -
    rr)``, equal in exact arithmetic (tests/losses/test_trl_parity.py compares the two in float32).
    TRL 1.16 ignores ``label_smoothing`` for ``"sigmoid"``; here it gives cDPO as written above.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``[B]`` policy sequence log-probs.
        ref_chosen_logps, ref_rejected_logps: ``[B]`` frozen-reference sequence log-probs.
        beta: KL-penalty strength (> 0).
        label_smoothing: assumed label-flip rate ``eps`` in ``[0, 0.5)``; "sigmoid"/"robust" only.
        loss_type: one of :data:`DPO_LOSS_TYPES`.

    Returns:
        ``losses [B]`` float32 and per-example ``[B]`` metrics ``rewards/chosen``
        (``beta (pc - rc)``), ``rewards/rejected`` (``beta (pr - rr)``), ``rewards/margins``,
        ``rewards/accuracies`` (1.0 where chosen reward > rejected), ``logps/chosen``,
        ``logps/rejected`` (policy), all detached.
    """
    pc, pr, rc, rr = _checked_f32(
        beta,
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    _check_loss_type(loss_type, DPO_LOSS_TYPES, label_smoothing)
    h = (pc - pr) - (rc - rr)
    losses = _pairwise_loss(h, beta, label_smoothing, loss_type)
    # Implicit rewards beta * log(pi / pi_ref) (DPO section 5); the reference is a constant here.
    metrics = _pairwise_metrics(beta * (pc - rc), beta * (pr - rr), pc, pr)
    return losses, metrics


def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
) -> tuple[Tensor, Metrics]:
    r"""IPO: squared regression of the log-ratio difference onto ``1 / (2 beta)``.

    Paper: Azar et al., "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", arXiv 2310.12036 (``tau = beta``)::

        h = (pc - rc) - (pr - rr);   loss = (h - 1 / (2 beta))^2

    This is :func:`dpo_loss` with ``loss_type="ipo"``: one implementation, shared with
    :func:`cpo_loss`'s ``"ipo"``. Which reduction to pass: token AVERAGES by default (TRL's
    convention; the paper writes sums), as :func:`default_logp_reduction` explains. The math here
    is identical either way.

    Shapes: four ``[B]`` tensors -> ``losses [B]``. Metrics as :func:`dpo_loss` (implicit rewards
    ``beta (pc - rc)``, ``beta (pr - rr)`` computed from whatever reduction was passed, as TRL).
    """
    return dpo_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=beta,
        loss_type="ipo",
    )


# --------------------------------------------------------------------------------------------
# reference-free pairwise methods
# --------------------------------------------------------------------------------------------


def simpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Metrics]:
    r"""SimPO: reference-free, length-normalised DPO with a target reward margin.

    Paper: Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    arXiv 2405.14734::

        z = beta * (avg_c - avg_r) - gamma
        loss = -(1 - eps) log sigma(z) - eps log sigma(-z)      (eps = label_smoothing)

    ``gamma`` is the paper's ABSOLUTE target margin in reward units. The authors' code and configs
    (princeton-nlp/SimPO) parameterise it as ``gamma_beta_ratio`` (``gamma = ratio * beta``; e.g.
    ``beta=2.5, gamma_beta_ratio=0.55`` means ``gamma=1.375``); TRL's ``CPOConfig(loss_type=
    "simpo", simpo_gamma=...)`` takes the absolute ``gamma`` like us. Convert ratio configs with
    ``gamma = gamma_beta_ratio * beta``.

    Pass length-AVERAGED log-probs (``TokenLogps.mean()``): the average is SimPO's reward
    (``beta * avg``) and what removes DPO's length bias without a reference model.

    Shapes: ``[B]``, ``[B]`` -> ``losses [B]``. Metrics (per-example ``[B]``, as TRL's CPOTrainer
    for "simpo"): ``rewards/chosen = beta * avg_c``, ``rewards/rejected = beta * avg_r``,
    ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` (averages).
    """
    c, r = _checked_f32(
        beta, chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps
    )
    if not math.isfinite(gamma):
        raise ValueError(f"gamma must be finite, got {gamma}")
    _check_label_smoothing(label_smoothing)
    losses = _smoothed_sigmoid_loss(beta * (c - r) - gamma, label_smoothing)
    return losses, _pairwise_metrics(beta * c, beta * r, c, r)


def cpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, Metrics]:
    r"""CPO preference term: DPO with the reference model dropped (uniform reference).

    Paper: Xu et al., "Contrastive Preference Optimization: Pushing the Boundaries of LLM
    Performance in Machine Translation", arXiv 2401.08417. With ``h = c - r``,
    ``z = beta * h``:

    - ``"sigmoid"``: ``-(1 - eps) log sigma(z) - eps log sigma(-z)`` (paper: ``eps = 0``);
    - ``"hinge"``: ``relu(1 - z)``;  ``"ipo"``: ``(h - 1 / (2 beta))^2`` (TRL's CPO variants).

    The full CPO objective adds a behaviour-cloning NLL on the chosen responses,
    ``L = mean_B(losses) + alpha * NLL(chosen)`` (TRL ``cpo_alpha``, default 1.0). That NLL is a
    token-level quantity, so the loss class computes it and combines with :func:`cpo_total_loss`.

    Pass SUMMED log-probs for "sigmoid"/"hinge" (TRL's default for CPO) and AVERAGED ones for
    "ipo", as TRL does (:func:`default_logp_reduction`).

    Shapes: ``[B]``, ``[B]`` -> ``losses [B]``. Metrics (per-example ``[B]``, as TRL):
    ``rewards/chosen = beta * c``, ``rewards/rejected = beta * r``, ``rewards/margins``,
    ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``.
    """
    c, r = _checked_f32(beta, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    _check_loss_type(loss_type, CPO_LOSS_TYPES, label_smoothing)
    losses = _pairwise_loss(c - r, beta, label_smoothing, loss_type)
    return losses, _pairwise_metrics(beta * c, beta * r, c, r)


def cpo_total_loss(pref_losses: Tensor, chosen_nll: Tensor, alpha: float = 1.0) -> Tensor:
    r"""CPO's full per-example loss: preference term plus ``alpha`` times the chosen NLL.

    Paper: Xu et al., "Contrastive Preference Optimization", arXiv 2401.08417
    (``L_CPO = L_prefer + L_NLL``; TRL weights the NLL by ``cpo_alpha``)::

        total = pref_losses + alpha * chosen_nll

    Shapes: ``pref_losses [B]`` (from :func:`cpo_loss`); ``chosen_nll`` either a scalar, TRL's
    convention (token-mean NLL over all chosen tokens of the batch, so ``total.mean()`` equals
    TRL's loss exactly), or ``[B]`` per-example NLL. Returns ``[B]`` float32 either way.
    """
    if not (chosen_nll.dim() == 0 or chosen_nll.shape == pref_losses.shape):
        raise ValueError(
            f"chosen_nll must be a scalar or match pref_losses {tuple(pref_losses.shape)}, "
            f"got {tuple(chosen_nll.shape)}"
        )
    _check_weight(alpha, "alpha")
    return pref_losses.float() + alpha * chosen_nll.float()


def orpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    beta: float = 0.1,
) -> tuple[Tensor, Metrics]:
    r"""ORPO's odds-ratio term (the NLL part is added by the loss class).

    Paper: Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model",
    arXiv 2403.07691 (``beta`` is the paper's ``lambda``). With ``p = exp(avg logp)``::

        log odds(p) = log p - log(1 - p) = avg - log1mexp(avg)
        lor         = log odds(p_c) - log odds(p_r)
        losses      = -beta * log sigma(lor)                                   [B]
        total ORPO  = NLL(chosen) - beta * mean_B(log sigma(lor))   (NLL: token mean over the
                                                                     batch's chosen tokens)

    Pass length-AVERAGED log-probs: ``p`` must be a per-token (geometric-mean) probability for
    ``1 - p`` to mean anything; with sums ``p ~ 0``, ``log(1 - p) ~ 0`` and the term degenerates
    to reference-free DPO on sums.

    Stability: ``log(1 - p)`` uses :func:`log1mexp` (TRL 1.16 uses the same branched form) on
    ``avg`` clamped to at most :data:`ORPO_MAX_AVG_LOGP` (-1e-6), so an average that rounds to 0
    gives a finite loss instead of -inf / NaN (the one deviation from TRL). The clamp only enters
    ``log(1 - p)``; the ``log p`` term keeps its gradient, so an (almost) certain rejected
    response is still pushed down. Identical to TRL for ``avg <= -1e-6``.

    Shapes: ``[B]``, ``[B]`` -> ``losses [B]``. Metrics (per-example ``[B]``, detached, TRL names
    and meanings): ``rewards/chosen = beta * avg_c``, ``rewards/rejected = beta * avg_r``,
    ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``,
    ``log_odds_ratio`` = ``log sigma(lor)`` (TRL logs the log-sigmoid under this name) and
    ``log_odds_chosen`` = ``lor`` itself.
    """
    c, r = _checked_f32(
        beta, chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps
    )
    log_odds_c = c - log1mexp(c.clamp(max=ORPO_MAX_AVG_LOGP))
    log_odds_r = r - log1mexp(r.clamp(max=ORPO_MAX_AVG_LOGP))
    lor = log_odds_c - log_odds_r
    ratio = F.logsigmoid(lor)
    losses = -beta * ratio
    metrics = _pairwise_metrics(beta * c, beta * r, c, r)
    metrics["log_odds_ratio"] = ratio.detach()
    metrics["log_odds_chosen"] = lor.detach()
    return losses, metrics


# --------------------------------------------------------------------------------------------
# reward modelling
# --------------------------------------------------------------------------------------------


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | float | None = None,
) -> tuple[Tensor, Metrics]:
    r"""Bradley-Terry pairwise reward-model loss, with Llama-2's optional margin.

    Papers: Bradley & Terry (1952) preference model as used for RLHF reward models in Ouyang et
    al., "Training language models to follow instructions with human feedback", arXiv 2203.02155;
    margin from Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models",
    arXiv 2307.09288 (eq. 2)::

        losses = -log sigma(r_c - r_r - m)        (m = 0 without a margin)

    The margin (e.g. larger for "significantly better" pairs) demands a larger reward gap before
    the loss saturates.

    Shapes: ``chosen_rewards [B]``, ``rejected_rewards [B]`` (scalar reward-head outputs);
    ``margin`` ``[B]``, scalar or None -> ``losses [B]``. Metrics (per-example ``[B]``):
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins`` (``r_c - r_r``, without ``m``),
    ``rewards/accuracies``.
    """
    _check_shapes(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    rc, rr = _f32(chosen_rewards, rejected_rewards)
    diff = rc - rr
    if margin is not None:
        m = torch.as_tensor(margin, dtype=torch.float32, device=rc.device)
        if m.dim() != 0 and m.shape != rc.shape:
            raise ValueError(
                f"margin must be a scalar or match the rewards {tuple(rc.shape)}, "
                f"got {tuple(m.shape)}"
            )
        diff = diff - m
    losses = -F.logsigmoid(diff)
    return losses, _pairwise_metrics(rc, rr)
