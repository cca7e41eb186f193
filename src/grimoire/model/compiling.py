"""``TrainingConfig.torch_compile``: ``torch.compile`` each transformer block, in place.

Why blocks and not the whole model:

- the fused log-prob path (:mod:`grimoire.forward.fused_head`) hooks the decoder's output and runs the
  LM head itself in chunks; a compiled whole model would see a new hook at every call (a
  recompile each time) and would trace the head the fused path exists to avoid;
- the blocks are identical, so one compiled graph serves them all (compile time of one block);
- in place (``nn.Module.compile``) keeps the model's type: peft, ``save_pretrained``, the
  reference's adapter switch and FSDP2's per-block sharding see the same modules as in eager.

When compiling cannot work the model stays eager and the reason is logged (never a crash):
no transformer blocks found, no C++ compiler for inductor on CPU, ``torch.compile`` raising, or
the first compiled call failing inside dynamo / the backend (then every block goes back to
eager and that call is re-run eagerly: compile errors happen before the graph runs, so nothing
ran twice).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo.exc  # what a failed compile raises (transformers' models load it anyway)

from grimoire.model.blocks import block_modules

logger = logging.getLogger(__name__)

#: The backend :func:`compile_blocks` uses (a module attribute so a test can force a failure).
BACKEND: Any = "inductor"


@dataclass
class CompileState:
    """What happened to one model's compilation: the compiled blocks, or why it is eager."""

    blocks: list[torch.nn.Module]
    fallback_reason: str | None = None

    @property
    def compiled(self) -> bool:
        return self.fallback_reason is None and bool(self.blocks)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        return block_modules(model)
    except ValueError:
        return []


def _precondition(model: torch.nn.Module, backend: Any) -> str | None:
    """Why compiling cannot work here, found before trying (``None``: try)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cuda = device.type == "cuda" or torch.cuda.is_available()
    if backend == "inductor" and not cuda:
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None and shutil.which("c++") is None:
            return f"inductor on CPU needs a C++ compiler and {cxx!r} is not on PATH"
    return None


def _fall_back(state: CompileState, reason: str) -> None:
    state.fallback_reason = reason
    for block in state.blocks:
        block._compiled_call_impl = None  # nn.Module.__call__ runs the eager _call_impl again
    logger.warning("torch_compile: running eager: %s", reason)


class _Guarded:
    """A block's compiled call that falls back to eager (all blocks) on a compile error."""

    def __init__(self, compiled: Any, block: torch.nn.Module, state: CompileState):
        self.compiled, self.block, self.state = compiled, block, state

    def __deepcopy__(self, memo: dict) -> None:
        # A copied model (the reference's ref_model="copy") gets eager blocks: the compiled
        # function belongs to the original block, and a frozen no-grad copy gains little.
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:  # tracing / backend failures
            # BackendCompilerFailed's own message is a header; the cause says what went wrong.
            inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
            lines = str(inner).strip().splitlines()
            _fall_back(
                self.state,
                f"{type(exc).__name__}: {type(inner).__name__}: {lines[0] if lines else ''}",
            )
            return self.block._call_impl(*args, **kwargs)


def compile_blocks(
    model: torch.nn.Module, *, backend: Any = None, mode: str | None = None
) -> CompileState:
    """Compile each transformer block of ``model`` in place; see the module docstring."""
    backend = BACKEND if backend is None else backend
    blocks = _blocks(model)
    state = CompileState(blocks)
    if not blocks:
        state.fallback_reason = (
            f"no transformer blocks found in {type(model).__name__} (its _no_split_modules is "
            "empty)"
        )
        logger.warning("torch_compile: running eager: %s", state.fallback_reason)
        return state
    reason = _precondition(model, backend)
    if reason is not None:
        _fall_back(state, reason)
        return state
    try:
        for block in blocks:
            compiled = torch.compile(block._call_impl, backend=backend, mode=mode)
            block._compiled_call_impl = _Guarded(compiled, block, state)
    except Exception as exc:  # e.g. an unknown mode or backend: refused before any call
        _fall_back(state, f"torch.compile raised {type(exc).__name__}: {exc}")
        return state
    logger.info("torch_compile: compiled %d %s blocks", len(blocks), type(blocks[0]).__name__)
    return state


def maybe_compile(model: torch.nn.Module, config: Any) -> CompileState | None:
    """``compile_blocks(model)`` when ``config.torch_compile``, else None (nothing done)."""
    if not getattr(config, "torch_compile", False):
        return None
    return compile_blocks(model)


__all__ = ["BACKEND", "CompileState", "compile_blocks", "maybe_compile"]
