"""Pure math of the offline preference methods, on already-reduced sequence log-probs.

Every loss here takes per-example log-probs (``[B]``; the caller has already summed or averaged
the per-token log-probs, see :class:`grimoire.logprobs.TokenLogps`) and returns
``(losses, metrics)``:

- ``losses``: ``[B]`` float32, one loss per example (per pair for pairwise methods). The caller
  reduces it (usually ``.mean()``), so micro-batch weighting stays the trainer's business.
- ``metrics``: ``dict[str, Tensor]``, all detached. Pairwise methods return *per-example* ``[B]``
  tensors (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
  ``logps/chosen``, ``logps/rejected``) so the caller can weight/gather them exactly like the loss;
  KTO, whose batches mix desirable and undesirable rows, returns sums and counts instead (TRL's
  ``rewards/chosen_sum`` / ``count/chosen`` convention), which aggregate correctly across
  micro-batches and ranks even when a micro-batch holds no row of one kind.

All math runs in float32 whatever the input dtype: bf16 has ~3 significant digits, and the
differences of sequence log-probs (``-300.1 - (-300.4)``) that every method is built on would be
mostly rounding noise. Gradients still flow back to the input dtype through the cast.

Metric names and reward definitions follow TRL's trainers so dashboards are comparable; the
reduction each method expects (sum vs length-average) is in each docstring and in
``docs/losses.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DPO_LOSS_TYPES",
    "bradley_terry_loss",
    "cpo_loss",
    "cpo_total_loss",
    "dpo_loss",
    "ipo_loss",
    "kto_kl_estimate",
    "kto_loss",
    "log1mexp",
    "orpo_loss",
    "simpo_loss",
]

Metrics = dict[str, Tensor]

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


def _f32(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.float() for t in tensors)


def _check_shapes(**tensors: Tensor) -> None:
    # Strict equality, not broadcastability: a [B] vs [B, 1] mix-up would silently broadcast to a
    # [B, B] loss whose mean is a meaningless number.
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"log-prob tensors must all have the same shape [B]; got {shapes}")


def _check_beta(beta: float, name: str = "beta") -> None:
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {beta}")


def _check_label_smoothing(label_smoothing: float) -> None:
    # eps = 0.5 makes the sigmoid loss constant (zero gradient) and divides by 0 in rDPO.
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


def _check_loss_type(loss_type: str, allowed: tuple[str, ...], label_smoothing: float) -> None:
    if loss_type not in allowed:
        from grimoire.errors import did_you_mean

        raise ValueError(
            f"unknown loss_type {loss_type!r}{did_you_mean(loss_type, allowed)}; "
            f"expected one of {list(allowed)}"
        )
    _check_label_smoothing(label_smoothing)
    # TRL silently ignores label_smoothing where it has no meaning; a user who set it expected an
    # effect, so it is an error here.
    if label_smoothing > 0 and loss_type not in ("sigmoid", "robust"):
        raise ValueError(
            f"label_smoothing={label_smoothing} has no meaning for loss_type={loss_type!r}; "
            "it applies to 'sigmoid' (cDPO) and 'robust' (rDPO) only"
        )


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
      Human Preferences", arXiv 2310.12036): ``(h - 1 / (2 beta))^2``; see
      :func:`ipo_loss` for which reduction to pass.
    - ``"robust"`` (rDPO, Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models
      with Noisy Feedback", arXiv 2403.00409): ``(-(1 - eps) log sigma(z) + eps log sigma(-z))
      / (1 - 2 eps)``.

    DPO's derivation is over sequence likelihoods, so pass SUMMED log-probs (TRL's default).
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
    _check_shapes(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    _check_beta(beta)
    _check_loss_type(loss_type, DPO_LOSS_TYPES, label_smoothing)
    pc, pr, rc, rr = _f32(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
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

    Which reduction to pass. The paper writes ``h`` with SEQUENCE log-likelihoods (sums). TRL's
    ``loss_type="ipo"`` instead divides every log-prob by its completion length (token AVERAGE)
    before forming ``h``. Pass AVERAGED log-probs by default (``TokenLogps.mean()``; what our
    IPOLoss does): unlike DPO's sigmoid, the squared loss never saturates, so with sums ``h`` scales
    with response length (tens to hundreds of nats) while the target ``1/(2 beta)`` does not; the
    fixed target then means different things for short and long pairs and the gradients
    (``2 (h - target)``) grow with length. Averages keep ``h`` O(1) and comparable across lengths.
    Pass sums (IPOLoss's "sum" option) only for the paper-exact objective, usually with a larger
    ``beta`` re-tuned for it. The math here is identical either way.

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
    _check_shapes(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    _check_beta(beta)
    if not math.isfinite(gamma):
        raise ValueError(f"gamma must be finite, got {gamma}")
    _check_label_smoothing(label_smoothing)
    c, r = _f32(chosen_avg_logps, rejected_avg_logps)
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

    Pass SUMMED log-probs for "sigmoid"/"hinge" (TRL's default for CPO); TRL averages them for
    "ipo" (see :func:`ipo_loss` for why).

    Shapes: ``[B]``, ``[B]`` -> ``losses [B]``. Metrics (per-example ``[B]``, as TRL):
    ``rewards/chosen = beta * c``, ``rewards/rejected = beta * r``, ``rewards/margins``,
    ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``.
    """
    _check_shapes(chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    _check_beta(beta)
    _check_loss_type(loss_type, CPO_LOSS_TYPES, label_smoothing)
    c, r = _f32(chosen_logps, rejected_logps)
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
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
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
    _check_shapes(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    _check_beta(beta)
    c, r = _f32(chosen_avg_logps, rejected_avg_logps)
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
# KTO
# --------------------------------------------------------------------------------------------


def kto_kl_estimate(
    policy_mismatched_logps: Tensor,
    ref_mismatched_logps: Tensor,
    reduce_fn: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    r"""KTO's reference point ``z0``: a batch estimate of ``KL(pi || pi_ref)``, detached, >= 0.

    Paper: Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
    arXiv 2402.01306 (section 4.1)::

        z0 = max(0, mean_j [log pi(y'_j | x_j) - log pi_ref(y'_j | x_j)])

    over MISMATCHED pairs ``(x_j, y'_j)`` (each prompt with another row's completion, i.e. the
    batch's completions shifted by one), so the estimate is not biased by the very completions
    being scored. Pass SUMMED log-probs, like :func:`kto_loss`. It is detached: gradients through
    ``z0`` destabilise training (paper) and TRL detaches too.

    ``reduce_fn`` (optional) maps this rank's scalar mean to the global one BEFORE the clamp, as
    TRL does (``gather(kl).mean().clamp(min=0)``), e.g. ``lambda t: accelerator.gather(t).mean()``.
    That mean of rank means equals the global mean only for equal per-rank counts; the caller may
    pass a sum/count all-reduce instead. Collective ops are the caller's job.

    Shapes: ``[M]``, ``[M]`` -> scalar float32 (0-d) tensor.
    """
    _check_shapes(
        policy_mismatched_logps=policy_mismatched_logps, ref_mismatched_logps=ref_mismatched_logps
    )
    if policy_mismatched_logps.numel() == 0:
        raise ValueError("kto_kl_estimate needs at least one mismatched pair (got an empty batch)")
    p, ref = _f32(policy_mismatched_logps, ref_mismatched_logps)
    kl = (p - ref).mean().detach()
    if reduce_fn is not None:
        kl = reduce_fn(kl).float().reshape(())
    # Clamp after the cross-rank mean: clamping per rank first would bias the estimate upwards.
    return kl.clamp(min=0).detach()


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    is_desirable: Tensor,
    kl: Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Metrics]:
    r"""KTO: prospect-theoretic value of each unpaired example against the reference point ``kl``.

    Paper: Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
    arXiv 2402.01306 (as implemented by TRL). With ``r = policy - ref``, ``z0 = kl``::

        desirable:   w_d * (1 - sigma(beta * (r - z0)))
        undesirable: w_u * (1 - sigma(beta * (z0 - r)))

    Pass SUMMED log-probs (paper and TRL). ``kl`` comes from :func:`kto_kl_estimate` (already
    detached, cross-rank reduced and clamped by the caller; it is detached again here so no
    gradient can flow through it). The paper recommends weights with
    ``w_d * n_desirable / (w_u * n_undesirable)`` in ``[1, 4/3]``.

    Args:
        policy_logps, ref_logps: ``[B]`` sequence log-probs of each row's own completion.
        is_desirable: ``[B]`` bool, True for desirable ("chosen") rows.
        kl: scalar reference point ``z0`` (0-d or 1-element tensor, or float).

    Returns:
        ``losses [B]`` in the input order (the mean equals TRL's mean over its chosen-then-rejected
        concatenation), and scalar metrics (sums + counts, so the caller can aggregate
        micro-batches/ranks that lack one kind): ``rewards/chosen_sum``, ``rewards/rejected_sum``
        (sum of ``beta * r`` over desirable / undesirable rows), ``logps/chosen_sum``,
        ``logps/rejected_sum`` (policy), ``count/chosen``, ``count/rejected``, ``kl``.
    """
    _check_shapes(policy_logps=policy_logps, ref_logps=ref_logps, is_desirable=is_desirable)
    if is_desirable.dtype != torch.bool:
        raise ValueError(f"is_desirable must be a bool tensor, got {is_desirable.dtype}")
    _check_beta(beta)
    for name, w in (
        ("desirable_weight", desirable_weight),
        ("undesirable_weight", undesirable_weight),
    ):
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {w}")
    p, ref = _f32(policy_logps, ref_logps)
    z0 = torch.as_tensor(kl, dtype=torch.float32, device=p.device).detach()
    if z0.numel() != 1:
        raise ValueError(f"kl must be a scalar, got shape {tuple(z0.shape)}")
    z0 = z0.reshape(())
    r = p - ref
    chosen_losses = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    rejected_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    # Both branches are finite everywhere, so torch.where's masked gradients are exact.
    losses = torch.where(is_desirable, chosen_losses, rejected_losses)

    rewards = (beta * r).detach()
    zero = torch.zeros((), dtype=torch.float32, device=p.device)
    undesirable = ~is_desirable
    metrics: Metrics = {
        "rewards/chosen_sum": torch.where(is_desirable, rewards, zero).sum(),
        "rewards/rejected_sum": torch.where(undesirable, rewards, zero).sum(),
        "logps/chosen_sum": torch.where(is_desirable, p.detach(), zero).sum(),
        "logps/rejected_sum": torch.where(undesirable, p.detach(), zero).sum(),
        "count/chosen": is_desirable.sum().float(),
        "count/rejected": undesirable.sum().float(),
        "kl": z0,
    }
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
