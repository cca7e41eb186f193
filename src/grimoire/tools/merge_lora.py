"""``grimoire merge-lora``: fold a saved LoRA adapter into its base and save a plain model.

Usage::

    grimoire merge-lora --adapter out/final --out out/merged [--base BASE] [--dtype float32]

The adapter's base comes from its ``base_model_name_or_path`` unless ``--base`` overrides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from grimoire.errors import GrimoireError
from grimoire.tools.common import DTYPES, ToolParser, adapter_base, load_for_inference, run_tool


def merge_lora(
    adapter: str | Path, out: str | Path, base: str | None = None, dtype: str = "auto"
) -> Path:
    """Merge a saved LoRA adapter into its base; write a plain model + tokenizer to ``out``."""
    adapter, out = Path(adapter), Path(out)
    adapter_base(adapter, base)  # the clear errors first, before loading anything
    if out.resolve() == adapter.resolve():
        raise GrimoireError(
            "--out must differ from --adapter (the adapter files would be mixed in)"
        )
    if out.exists() and any(out.iterdir()):
        raise GrimoireError(f"--out {out} exists and is not empty; choose a new directory")
    model, tokenizer, _ = load_for_inference(adapter, base, dtype, merge=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: Sequence[str]) -> int:
    """``grimoire merge-lora``: returns the exit code."""
    p = ToolParser(
        prog="grimoire merge-lora",
        description="Merge a saved LoRA adapter into its base model and save a plain model "
        "(loadable with from_pretrained, no peft needed).",
    )
    p.add_argument("--adapter", required=True, help="folder with adapter_config.json")
    p.add_argument("--out", required=True, help="new folder for the merged model + tokenizer")
    p.add_argument("--base", help="base model (default: the adapter's base_model_name_or_path)")
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="load/merge/save dtype (auto: the base's)"
    )

    def body() -> int:
        args = p.parse_args(list(argv))
        out = merge_lora(args.adapter, args.out, args.base, args.dtype)
        print(f"merged model saved to {out}")
        return 0

    return run_tool("merge-lora", body)


__all__ = ["main", "merge_lora"]
