"""What the after-a-run tools share: their CLI helpers and loading a saved model.

The small CLI helpers (:class:`ToolParser`, :func:`run_tool`) are used by ``grimoire plot``,
``grimoire merge-lora`` and ``grimoire generate`` so every tool reports errors the same way:
``grimoire <cmd>: <message>``.

:func:`load_for_inference` (used by ``merge-lora`` and ``generate``) accepts either a full model
folder or a saved LoRA adapter (``adapter_config.json``); the adapter's base comes from its
``base_model_name_or_path`` unless ``--base`` overrides it (bases are often local paths that
have moved since training).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from grimoire.columns import pad_token_id_of
from grimoire.errors import ConfigError, GrimoireError
from grimoire.model.gguf import resolve_pretrained

DTYPES = ("auto", "float32", "bfloat16", "float16")


# --------------------------------------------------------------------------- shared CLI helpers


#: What each tool's ``--help`` ends with, by command (a tool may pass its own ``example=``).
TOOL_EXAMPLES: dict[str, tuple[str, ...]] = {
    "plot": (
        "grimoire plot output/quickstart",
        "grimoire plot output/run_a output/run_b --out compare.html",
    ),
    "generate": ('grimoire generate --model output/quickstart/final --prompt "reverse abcdef="',),
    "merge-lora": ("grimoire merge-lora --adapter output/run/final --out output/run/merged",),
}


class ToolParser(argparse.ArgumentParser):
    """An argument parser whose usage errors become :class:`GrimoireError` (exit code 1), whose
    help ends with an example, and which accepts ``--log-level`` like every ``grimoire`` command
    (``grimoire`` reads it before the tool runs)."""

    def __init__(self, *args: Any, example: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        command = self.prog.removeprefix("grimoire ")
        self.examples = tuple(example) if example is not None else TOOL_EXAMPLES.get(command, ())
        self.add_argument(
            "--log-level",
            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            type=str.upper,
            help="INFO or DEBUG: the libraries' progress bars and warnings too; DEBUG: an "
            "error's traceback",
        )

    def format_help(self) -> str:
        if not self.examples:
            return super().format_help()
        head = "example:" if len(self.examples) == 1 else "examples:"
        lines = "".join(f"  {line}\n" for line in self.examples)
        return f"{super().format_help()}\n{head}\n{lines}"

    def error(self, message: str) -> NoReturn:
        raise GrimoireError(f"{message} (see {self.prog} --help)")


def run_tool(command: str, body: Callable[[], int]) -> int:
    """Run ``body``; print ``grimoire <command>: <message>`` for a Grimoire error, return 1.

    Other exceptions propagate to ``grimoire``'s own handler, which prints them as one message
    too; with ``--log-level DEBUG`` the traceback is logged first.
    """
    try:
        return body()
    except GrimoireError as exc:
        logging.getLogger(__name__).debug("the traceback:", exc_info=exc)
        print(f"grimoire {command}: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


# --------------------------------------------------------------------------- loading


def adapter_base(adapter_dir: Path, base: str | None) -> tuple[str, dict[str, Any]]:
    """The base model path for a saved peft adapter, and the adapter's config."""
    cfg_path = adapter_dir / "adapter_config.json"
    if not adapter_dir.is_dir():
        raise GrimoireError(f"{adapter_dir}: no such directory")
    if not cfg_path.is_file():
        hint = (
            " It holds a full model (config.json): use it directly, there is nothing to merge."
            if (adapter_dir / "config.json").is_file()
            else ""
        )
        raise GrimoireError(
            f"{cfg_path} not found: {adapter_dir} is not a saved LoRA adapter (trainer.save_model "
            f"writes one when training with a peft config).{hint}"
        )
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise GrimoireError(f"{cfg_path}: not valid JSON ({exc})") from exc
    base = base or config.get("base_model_name_or_path")
    if not base:
        raise GrimoireError(
            f"{cfg_path} has no base_model_name_or_path; pass the base model with --base PATH"
        )
    return base, config


def torch_dtype(name: str) -> Any:
    """``--dtype`` (one of :data:`DTYPES`) as ``from_pretrained``'s ``dtype`` argument."""
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def load_for_inference(
    path: str | Path, base: str | None = None, dtype: str = "auto", merge: bool = False
) -> tuple[Any, Any, str]:
    """``(model, tokenizer, base)`` for a full model folder, a LoRA adapter folder, or a GGUF
    file (converted once, :mod:`grimoire.model.gguf`).

    An adapter is loaded onto its base as a ``PeftModel`` (merged and unloaded when ``merge``).
    The tokenizer comes from the folder when it holds one (``GrimoireTrainer.save_model`` saves
    it beside the adapter), else from the base.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging

    # Only the tool's own output: no "Loading weights" progress bars on a one-shot command.
    hf_logging.disable_progress_bar()

    try:  # a .gguf file or grimoire://models/<name>: its cached transformers folder
        path = Path(resolve_pretrained(str(path), where="--model"))
    except ConfigError as exc:
        raise GrimoireError("; ".join(exc.problems)) from exc
    is_adapter, base_path, adapter_cfg = _model_source(path, base)
    # Reward models are trained as sequence classifiers; their adapters say so, and carry the
    # trained head, whose size the base's config.json does not know (it says 2 labels).
    kwargs: dict[str, Any] = {}
    auto = AutoModelForCausalLM
    if adapter_cfg.get("task_type") == "SEQ_CLS":
        auto, kwargs = AutoModelForSequenceClassification, {"num_labels": _head_size(path)}
    try:
        model = auto.from_pretrained(base_path, dtype=torch_dtype(dtype), **kwargs)
    except (OSError, ValueError) as exc:
        where = " (base_model_name_or_path of the adapter; override it with --base)"
        raise GrimoireError(
            f"cannot load model {base_path!r}{where if is_adapter else ''}: {exc}"
        ) from exc
    if is_adapter:
        from peft import PeftModel

        with warnings.catch_warnings():  # transformers' deprecation note raised inside peft
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            model = PeftModel.from_pretrained(model, str(path))
        if merge:
            model = model.merge_and_unload()
    tok_dir = path if (path / "tokenizer_config.json").is_file() else base_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    except (OSError, ValueError) as exc:
        raise GrimoireError(f"cannot load a tokenizer from {tok_dir}: {exc}") from exc
    if getattr(model.config, "pad_token_id", None) is None:  # sequence scores need it
        model.config.pad_token_id = pad_token_id_of(tokenizer, model)
    model.eval()
    return model, tokenizer, base_path


def _model_source(path: Path, base: str | None) -> tuple[bool, str, dict[str, Any]]:
    """``(is_adapter, base_path, adapter_config)`` of a saved folder: a LoRA adapter (its base
    from ``base`` or the adapter's config) or a full model; an error naming what is missing."""
    if not path.is_dir():
        raise GrimoireError(f"{path}: no such directory")
    if (path / "adapter_config.json").is_file():
        return (True, *adapter_base(path, base))
    if (path / "config.json").is_file():
        return False, str(path), {}
    raise GrimoireError(
        f"{path} holds neither a model (config.json) nor a LoRA adapter (adapter_config.json)"
        + saved_model_hint(path)
    )


def saved_model_hint(path: Path) -> str:
    """For a training run's folder (``output_dir``): where its saved model is, e.g.
    ``; it is a training run's folder: its final model is out/final (give --model out/final)``."""
    saved = [
        sub
        for sub in sorted(path.iterdir())
        if sub.is_dir()
        and not sub.name.startswith("checkpoint-")
        and any((sub / f).is_file() for f in ("config.json", "adapter_config.json"))
    ]
    if not saved:
        return ""
    final = path / "final"
    pick = final if final in saved else saved[0]
    others = [str(s) for s in saved if s != pick]
    also = f" (also saved here: {', '.join(others)})" if others else ""
    return (
        f"; it is a training run's folder: its {'final ' if pick == final else ''}model is "
        f"{pick} (give --model {pick}){also}"
    )


def _head_size(adapter_dir: Path) -> int:
    """Outputs of the classification head saved with a SEQ_CLS adapter (1 for reward models)."""
    from safetensors import safe_open

    weights = adapter_dir / "adapter_model.safetensors"
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key.endswith(("score.weight", "classifier.weight")):
                    return int(f.get_slice(key).get_shape()[0])
    raise GrimoireError(f"{weights}: no classification head (score.weight) in the SEQ_CLS adapter")


__all__ = [
    "DTYPES",
    "ToolParser",
    "adapter_base",
    "load_for_inference",
    "run_tool",
    "torch_dtype",
]
