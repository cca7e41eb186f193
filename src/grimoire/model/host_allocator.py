"""Give freed tensors back to the operating system on a CPU run (glibc's mmap threshold).

A training step on a CPU allocates its activations, gradients and temporaries through ``malloc``
and frees them by the end of the step. glibc serves a block of at least ``M_MMAP_THRESHOLD``
bytes with its own ``mmap`` and returns it to the OS when freed; smaller ones come from the
heap, which keeps what is freed. The threshold starts at 128 KiB but is *dynamic*: every freed
``mmap`` block raises it to that block's size (up to 32 MiB), so after the first step most
activation tensors (a ``[tokens, hidden]`` fp32 tensor is a few MiB) are carved out of the heap.
Rows of varied length then leave holes that later, larger batches cannot reuse, and the
process's resident memory climbs step after step above what is ever alive at once. Measured on
SmolLM2-135M-Instruct with mixed-length chat rows (docs/performance.md): peak RSS 7.08 GiB for
DPO with the default, 6.20 GiB with the threshold fixed at 1 MiB, and 2.9 GiB resident between
steps instead of 6.9 GiB (the weights, gradients and AdamW states are 2.7 GiB); SFT 5.24 GiB
and 4.75 GiB.

:func:`return_freed_memory` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``), which
also turns the dynamic raise off: every tensor of 1 MiB or more is mapped for its lifetime and
unmapped when freed, so the resident peak is the live peak. The price is paid in page
faults: memory given back is faulted in (and zeroed by the kernel) again the next time it is
used. On this repository's VM a 9.6 MB tensor made, written and freed took 4.4 ms of CPU instead
of 0.2-0.3 ms, and the SmolLM2 SFT run above took 5.3x the page faults and 27% more user CPU
time (213 vs 168 s, 4 steps with the model load; a shared machine, so a rough figure). So it is
opt-in (``TrainingConfig.return_freed_memory``, off by default): for a CPU run that must fit in
less memory and can spend the time. It is process-wide and cannot be undone (glibc has no
"dynamic again"). Other C libraries (musl, macOS) are left alone: the call is made only where
glibc's ``mallopt`` exists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: glibc's ``M_MMAP_THRESHOLD`` parameter number (malloc.h).
M_MMAP_THRESHOLD = -3

#: Blocks of at least this many bytes are mapped and unmapped on their own: far below a step's
#: activation tensors (MiBs), above the small tensors and Python objects that churn (KiBs).
MMAP_THRESHOLD_BYTES = 1 << 20


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        # gnu_get_libc_version exists only in glibc: musl and others have mallopt stubs or none.
        libc.gnu_get_libc_version  # noqa: B018
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (module docstring).

    Returns whether it was set (False where the C library is not glibc or refused it)."""
    mallopt = _mallopt()
    if mallopt is None:
        logger.info("freed tensors: left to the C library's allocator (not glibc)")
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    if ok:
        logger.info(
            "freed tensors: returned to the OS (glibc mmap threshold fixed at %d KiB)",
            threshold >> 10,
        )
    return ok
