"""Optional fused GPU kernels (Liger) for the decoder body: RMSNorm, RoPE, SwiGLU / GeGLU.

Only the decoder body is patched. The LM head + log-softmax stays on Grimoire's own chunked path
(:mod:`grimoire.forward.logprobs`): Liger's fused linear cross-entropy returns a scalar loss, while every
Grimoire loss needs per-token log-probs (DPO / KTO / GRPO ratios, masks, entropy), and we could
not measure Liger against our path on a GPU here. See ``docs/fused-logprobs.md``.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from grimoire.errors import ConfigError
from grimoire.model.blocks import peft_base

logger = logging.getLogger(__name__)

#: Kernels we ask Liger for. Loss-side kernels stay off: they would replace the model's forward
#: (and its logits) with a fused loss, which the per-token log-prob path can't use.
LIGER_KERNELS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "geglu": True,  # Gemma's MLP; ignored by Liger for models without it
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def apply_liger(model: torch.nn.Module) -> torch.nn.Module:
    """Patch ``model``'s RMSNorm / RoPE / SwiGLU (GeGLU) with Liger's Triton kernels, in place.

    Needs ``liger-kernel`` (``pip install 'grimoire[liger]'``) and a CUDA GPU; raises
    :class:`~grimoire.errors.ConfigError` naming whichever is missing, or when Liger has no
    kernels for the model's architecture. Note that Liger patches some functions at module level
    (e.g. ``apply_rotary_pos_emb`` of the model's ``modeling_*`` module), so other models of the
    same architecture in this process are affected too.

    Returns the same model, for chaining.
    """
    problems = []
    if importlib.util.find_spec("liger_kernel") is None:
        problems.append(
            "use_liger=True needs the liger-kernel package: pip install 'grimoire[liger]'"
        )
    if not torch.cuda.is_available():
        problems.append(
            "use_liger=True needs a CUDA GPU (Liger's kernels are Triton GPU kernels); "
            "set use_liger=False on this machine"
        )
    if problems:
        raise ConfigError(problems, title="cannot apply Liger kernels")

    from liger_kernel.transformers import monkey_patch

    base = peft_base(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    supported = getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {})
    if model_type not in supported:
        raise ConfigError(
            [
                f"Liger has no kernels for model_type={model_type!r} "
                f"(supported: {', '.join(sorted(supported)) or 'none found'}); "
                "set use_liger=False"
            ],
            title="cannot apply Liger kernels",
        )
    # Liger filters the flags by what the architecture's patch function accepts.
    monkey_patch._apply_liger_kernel_to_instance(model=base, **LIGER_KERNELS)
    logger.info("applied Liger kernels to %s (%s)", type(base).__name__, model_type)
    return model


__all__ = ["LIGER_KERNELS", "apply_liger"]
