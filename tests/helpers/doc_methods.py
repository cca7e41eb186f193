"""The custom methods docs/custom-loss.md shows, built from the page's own code blocks, so the
tests train exactly what a reader copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.test_docs import python_blocks

CUSTOM_LOSS_DOC = Path(__file__).resolve().parents[2] / "docs" / "custom-loss.md"


def doc_class_blocks() -> list[Any]:
    """The page's Python blocks that define a class (the methods a reader writes)."""
    return [b for b in python_blocks(CUSTOM_LOSS_DOC) if "\nclass " in f"\n{b.code}"]


def docs_minimal_loss() -> type:
    """``MinimalLoss``, the smallest method the page shows, run from its code block."""
    (block,) = [b for b in doc_class_blocks() if "class MinimalLoss" in b.code]
    namespace: dict[str, Any] = {"__name__": "custom_loss_doc"}
    exec(compile(block.code, f"{CUSTOM_LOSS_DOC}:{block.line}", "exec"), namespace)
    return namespace["MinimalLoss"]
