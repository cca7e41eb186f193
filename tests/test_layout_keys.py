"""Only the collators and the layout read a batch's keys to learn its layout.

A batch states its layout (``grimoire.contract.layout``: ``Padded`` / ``Packed``, under
``batch["layout"]``) and the layout answers what the rest of the code needs: its rows, its
trained targets, its real tokens, whether it holds prompts to evaluate, what attention inputs
the model takes. This test reads every module outside ``collate/`` (which writes the keys) and
``contract/`` (which answers from them) with ``ast`` and fails on code that learns the layout
from the keys instead:

- a membership test on a layout key: ``"position_ids" in batch``, ``"seq_lens" not in b``,
  ``f"{side}attention_mask" in batch`` (and on the keys that told an evaluation batch of prompts
  from a training batch: ``"completion_mask"``, ``"prompt_input_ids"``);
- ``.get(<layout key>)``: ``batch.get("cu_seqlens")``, ``batch.get(f"{p}position_ids")``;
- reading the layout key itself (``batch["layout"]``, ``batch[LAYOUT_KEY]``) instead of
  ``layout_of(batch)``;
- a key scan: a loop or comprehension over a batch's keys (``for key in batch``,
  ``batch.items()``, ``batch.keys()``) that tests the key's name (``key.endswith("input_ids")``,
  ``key == ...``, ``key in (...)``).

Reading a tensor once the layout is known (``batch["position_ids"]`` inside the packed branch)
is fine: that is data, not a guess.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import pytest

from grimoire.contract.layout import LAYOUT_KEY, LAYOUT_KEYS

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "grimoire"
#: Where the keys are written (collate/) and answered from (contract/).
ALLOWED = ("collate", "contract")
#: Keys whose presence told an evaluation batch of prompts from a training batch.
BATCH_KIND_KEYS = ("completion_mask", "prompt_input_ids")
#: Names of a model forward's keyword arguments (``model/`` hooks the forward: NEFTune, packed
#: attention), which are what the model was called with, not a batch.
MODEL_CALL_ARGUMENTS = ("kwargs",)
#: The guarded keys (stated here so a change to the list shows in this file's diff).
GUARDED = (
    "layout",
    "position_ids",
    "attention_mask",
    "sample_index",
    "seq_lens",
    "cu_seqlens",
    "max_seqlen",
)


def _key_of(node: ast.AST) -> str | None:
    """The batch key a constant or f-string names (an f-string by its constant tail), or the
    layout key's own name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        tail = node.values[-1]
        if isinstance(tail, ast.Constant) and isinstance(tail.value, str):
            return tail.value
    if isinstance(node, ast.Name) and node.id == "LAYOUT_KEY":
        return LAYOUT_KEY
    return None


def _is_layout_key(node: ast.AST, keys: tuple[str, ...] = LAYOUT_KEYS) -> bool:
    key = _key_of(node)
    if key is None:
        return False
    # f"{prefix}attention_mask" names a layout key by its tail; a constant must match exactly.
    exact = isinstance(node, ast.Constant | ast.Name)
    return key in keys if exact else any(key.endswith(k) for k in keys)


def _iterated_batch(node: ast.AST) -> bool:
    """``batch`` / ``batch.items()`` / ``batch.keys()`` for a name that holds a batch."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("items", "keys")
        and not node.args
    ):
        node = node.func.value
    return isinstance(node, ast.Name) and "batch" in node.id


def _tests_name(body: Sequence[ast.AST], var: str) -> bool:
    """Whether ``var`` (a key) is tested by name anywhere in ``body``."""
    for node in (n for part in body for n in ast.walk(part)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if node.func.attr in ("endswith", "startswith") and _named(target, var):
                return True
        if isinstance(node, ast.Compare) and _named(node.left, var):
            return True
    return False


def _named(node: ast.AST, var: str) -> bool:
    return isinstance(node, ast.Name) and node.id == var


def _key_var(target: ast.AST) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name):
        return target.elts[0].id
    return None


def layout_key_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for every read of a batch's keys that learns its layout."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        ):
            if _is_layout_key(node.left, LAYOUT_KEYS + BATCH_KIND_KEYS):
                found.append((node.lineno, f"membership test {ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            model_call = isinstance(receiver, ast.Name) and receiver.id in MODEL_CALL_ARGUMENTS
            if node.func.attr == "get" and node.args and _is_layout_key(node.args[0]):
                if model_call:
                    continue
                found.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _key_of(node.slice) == LAYOUT_KEY and _is_layout_key(node.slice, (LAYOUT_KEY,)):
                found.append((node.lineno, f"{ast.unparse(node)} (use layout_of)"))
        elif isinstance(node, ast.For) and _iterated_batch(node.iter):
            var = _key_var(node.target)
            if var is not None and _tests_name(node.body, var):
                found.append((node.lineno, f"key scan over {ast.unparse(node.iter)}"))
        elif isinstance(node, ast.comprehension) and _iterated_batch(node.iter):
            var = _key_var(node.target)
            if var is not None and _tests_name(node.ifs, var):
                found.append((node.iter.lineno, f"key scan over {ast.unparse(node.iter)}"))
    return found


def test_the_guarded_keys_are_the_layout_modules_own():
    assert LAYOUT_KEYS == GUARDED


def test_no_module_outside_collate_and_contract_reads_batch_keys_to_learn_the_layout():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ALLOWED:
            continue
        for line, what in layout_key_reads(ast.parse(path.read_text(encoding="utf-8"))):
            problems.append(f"src/grimoire/{rel}:{line}: {what}")
    assert not problems, "ask the layout (grimoire.contract.layout) instead:\n" + "\n".join(
        problems
    )


@pytest.mark.parametrize(
    "source",
    [
        'if "position_ids" in batch: pass',
        'ok = "seq_lens" not in b',
        'x = batch.get("cu_seqlens")',
        'x = batch.get(f"{side}attention_mask")',
        'if f"{p}position_ids" in features[0]: pass',
        'if "completion_mask" not in batch: pass',
        "x = batch[LAYOUT_KEY]",
        'x = batch["layout"]',
        'for key, value in batch.items():\n    if key.endswith("input_ids"): pass',
        'n = [v for k, v in batch.items() if k == "labels"]',
        "for key in batch:\n    if key in KNOWN: pass",
    ],
)
def test_each_way_of_reading_the_layout_from_keys_is_caught(source):
    assert layout_key_reads(ast.parse(source)), source


@pytest.mark.parametrize(
    "source",
    [
        'ids, pos = batch["input_ids"], batch["position_ids"]',
        'mask = kwargs.get("attention_mask")',
        'x = batch.get("old_logps")',
        "moved = {k: v.to(device) for k, v in batch.items()}",
        'batch = {**rows, LAYOUT_KEY: Padded()}\nbatch["layout"] = Packed((3,))',
        'if "kl_input_ids" in row: pass',
    ],
)
def test_reading_data_once_the_layout_is_known_is_not_flagged(source):
    assert not layout_key_reads(ast.parse(source)), source
