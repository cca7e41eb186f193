"""Which autocast precision a run gets: ``mixed_precision="auto"`` asks the hardware.

bf16 autocast only pays where the matmuls have a native bf16 path. On a CUDA GPU that is
``torch.cuda.is_bf16_supported()``. On a CPU, torch sends bf16 GEMMs to oneDNN, which is fast
with AMX-BF16 or AVX512-BF16 instructions; without them the backward pass's transposed bf16
matmuls fall back to a scalar kernel and a step is about 30x slower than fp32 (measured on an
AMD EPYC with AVX2, 4 x 256 Llama, 32k vocabulary).

CPU detection reads the instruction-set flags (``/proc/cpuinfo``) rather than timing a probe
matmul: the flags are exact and free, while a probe under 0.5 s on a machine shared with other
processes (or with its first-call oneDNN kernel generation) can mistime either way. The flags
are checked together with ``torch.backends.mkldnn.is_available()`` (no oneDNN: no fast bf16
GEMM whatever the CPU has). ``torch.backends.cpu.get_cpu_capability()`` (the ATen kernel level)
is logged alongside, since it says which elementwise kernels run.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import torch

from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError, GrimoireWarning

logger = logging.getLogger(__name__)

#: x86 flags that give oneDNN a native bf16 dot product (Sapphire Rapids AMX, Cooper Lake / Zen 4
#: AVX512-BF16).
X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")

#: What the slow path cost where it was measured.
SLOW_BF16_NOTE = (
    "measured ~30x slower per step than fp32 on an AVX2 AMD EPYC (4-layer x 256 Llama, 32k "
    "vocabulary): the backward pass's transposed bf16 matmuls fall back to a scalar kernel"
)


@dataclass(frozen=True)
class CpuBf16:
    """Whether this CPU computes bf16 matmuls natively, and what that was read from."""

    native: bool
    flags: tuple[str, ...]  # the bf16 flags found (subset of X86_BF16_FLAGS)
    capability: str  # torch.backends.cpu.get_cpu_capability()
    reason: str


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's instruction-set flags (``flags`` on x86, ``Features`` on ARM); empty where the
    file cannot be read (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_capability() -> str:
    """torch's ATen CPU kernel level (``AVX2``, ``AVX512``, ``DEFAULT``, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch builds without the query
        return "unknown"


@functools.cache
def detect_cpu_bf16() -> CpuBf16:
    """Read once per process: the flags cannot change while it runs."""
    flags = cpu_flags()
    found = tuple(f for f in X86_BF16_FLAGS if f in flags)
    capability = cpu_capability()
    if not torch.backends.mkldnn.is_available():
        return CpuBf16(False, found, capability, "this torch build has no oneDNN (mkldnn)")
    if found:
        return CpuBf16(True, found, capability, f"CPU has {'/'.join(found)}")
    if not flags:
        return CpuBf16(False, found, capability, "CPU flags unreadable (no /proc/cpuinfo)")
    return CpuBf16(False, found, capability, "CPU has neither AMX-BF16 nor AVX512-BF16")


def _other_accelerator() -> bool:
    return hasattr(torch, "accelerator") and torch.accelerator.is_available()


def decide(requested: str, *, cuda: bool | None = None) -> tuple[str, str]:
    """``(precision, why)`` for ``requested``, with no logging or warning: what
    :func:`resolve_auto` returns, for code that only needs the answer (FSDP2's policy, the
    reference cache's autocast). ``cuda``: whether training runs on a CUDA GPU (default:
    ``torch.cuda.is_available()``)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    if requested != "auto":
        return requested, "set explicitly"
    if cuda:
        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA GPU supports bf16"
        return "no", "CUDA GPU does not support bf16"
    if _other_accelerator():
        # MPS, XPU, ...: no measured basis for bf16 there yet, so the safe fp32.
        return "no", "non-CUDA accelerator"
    cpu = detect_cpu_bf16()
    return ("bf16" if cpu.native else "no"), f"CPU, cpu capability {cpu.capability}; {cpu.reason}"


def resolve_auto(requested: str, *, cuda: bool | None = None) -> str:
    """The precision to run: ``"no"``, ``"fp16"`` or ``"bf16"`` for ``requested``, logged.

    ``"auto"`` becomes bf16 on a CUDA GPU with bf16 and on a CPU with native bf16, else ``"no"``
    (fp32). An explicit ``"bf16"`` on a CPU without native bf16 is kept, with a warning.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    choice, why = decide(requested, cuda=cuda)
    on_cpu = not cuda and not _other_accelerator()
    cpu = detect_cpu_bf16() if on_cpu else None
    if cpu is not None and requested == "bf16" and not cpu.native:
        warnings.warn(
            f"mixed_precision='bf16' on a CPU without native bf16 ({cpu.reason}; cpu capability "
            f"{cpu.capability}): training will be much slower than fp32 ({SLOW_BF16_NOTE}). Set "
            "mixed_precision to 'auto' or 'no' for fp32.",
            GrimoireWarning,
            stacklevel=3,
        )
    if cpu is not None and requested != "auto":
        why = f"{why}; CPU, cpu capability {cpu.capability}; {cpu.reason}"
    logger.info("mixed_precision=%r -> %r (%s)", requested, choice, why)
    return choice


def resolve_mixed_precision(config: TrainingConfig) -> str:
    """The precision accelerate is asked for; fp16 needs CUDA (its loss scaler).

    ``"auto"`` is decided by the hardware (:func:`resolve_auto`: bf16 where the GPU or CPU has
    native bf16 matmuls, else fp32), and an explicit bf16 on a CPU without it warns.
    """
    if config.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError(
            [
                "mixed_precision='fp16' needs a CUDA GPU; on CPU use 'auto', 'bf16' (fast with "
                "AMX or AVX512-BF16) or 'no'"
            ]
        )
    precision = resolve_auto(config.mixed_precision)
    if config.distributed == "fsdp2":
        return "no"  # FSDP2's MixedPrecisionPolicy casts the gathered weights instead of autocast
    return precision


__all__ = [
    "SLOW_BF16_NOTE",
    "X86_BF16_FLAGS",
    "CpuBf16",
    "cpu_capability",
    "cpu_flags",
    "decide",
    "detect_cpu_bf16",
    "resolve_auto",
    "resolve_mixed_precision",
]
