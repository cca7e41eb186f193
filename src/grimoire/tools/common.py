"""``grimoire merge-lora`` and ``grimoire generate``: using a trained model after a run.

Usage::

    grimoire merge-lora --adapter out/final --out out/merged [--base BASE] [--dtype float32]
    grimoire generate --model out/final --prompt "reverse abcdef=" [--chat] [--temperature 0.7]

Both accept either a full model folder or a saved LoRA adapter (``adapter_config.json``) for
``--model``/``--adapter``; the adapter's base comes from its ``base_model_name_or_path`` unless
``--base`` overrides it (bases are often local paths that have moved since training).

The small CLI helpers here (:class:`ToolParser`, :func:`run_tool`) are shared with
``grimoire plot`` so every tool reports errors the same way: ``grimoire <cmd>: <message>``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from grimoire.errors import GrimoireError

DTYPES = ("auto", "float32", "bfloat16", "float16")


# --------------------------------------------------------------------------- shared CLI helpers


class ToolParser(argparse.ArgumentParser):
    """An argument parser whose usage errors become :class:`GrimoireError` (exit code 1)."""

    def error(self, message: str) -> NoReturn:
        raise GrimoireError(f"{message} (see {self.prog} --help)")


def run_tool(command: str, body: Callable[[], int]) -> int:
    """Run ``body``; print ``grimoire <command>: <message>`` for a Grimoire error, return 1."""
    try:
        return body()
    except GrimoireError as exc:
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
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def load_for_inference(
    path: str | Path, base: str | None = None, dtype: str = "auto", merge: bool = False
) -> tuple[Any, Any, str]:
    """``(model, tokenizer, base)`` for a full model folder or a LoRA adapter folder.

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

    path = Path(path)
    if not path.is_dir():
        raise GrimoireError(f"{path}: no such directory")
    is_adapter = (path / "adapter_config.json").is_file()
    if is_adapter:
        base_path, adapter_cfg = adapter_base(path, base)
    elif (path / "config.json").is_file():
        base_path, adapter_cfg = str(path), {}
    else:
        raise GrimoireError(
            f"{path} holds neither a model (config.json) nor a LoRA adapter (adapter_config.json)"
        )
    # Reward models are trained as sequence classifiers; their adapters say so, and carry the
    # trained head, whose size the base's config.json does not know (it says 2 labels).
    auto, kwargs = AutoModelForCausalLM, {}
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
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer, base_path


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


# --------------------------------------------------------------------------- merge-lora


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


def merge_lora_main(argv: Sequence[str]) -> int:
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


# --------------------------------------------------------------------------- generate


def sampling_problems(
    max_new_tokens: int, temperature: float, top_p: float, num_return_sequences: int
) -> list[str]:
    """Problems with the generation settings (checked before any model is loaded)."""
    problems = []
    if max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        problems.append(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {top_p}")
    if num_return_sequences < 1:
        problems.append(f"--num-return-sequences must be >= 1, got {num_return_sequences}")
    elif num_return_sequences > 1 and temperature == 0:
        problems.append(
            "--num-return-sequences > 1 needs --temperature > 0 (greedy decoding gives one answer)"
        )
    return problems


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    chat: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    num_return_sequences: int = 1,
) -> list[str]:
    """Completions of ``prompt`` (new tokens only, decoded): greedy at temperature 0."""
    import torch

    from grimoire.rollout.generation import encode_prompt, generation_mode

    problems = sampling_problems(max_new_tokens, temperature, top_p, num_return_sequences)
    if chat and not getattr(tokenizer, "chat_template", None):
        problems.append(
            "--chat: this tokenizer has no chat template; drop --chat to send the prompt as "
            "plain text, or use a model whose tokenizer_config.json has a chat_template"
        )
    if problems:
        raise GrimoireError("; ".join(problems))

    ids = encode_prompt(tokenizer, [{"role": "user", "content": prompt}] if chat else prompt)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad(), generation_mode(model):
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_return_sequences,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
    return tokenizer.batch_decode(out[:, len(ids) :], skip_special_tokens=True)


def generate_main(argv: Sequence[str]) -> int:
    """``grimoire generate``: print the completion(s) of one prompt; returns the exit code."""
    p = ToolParser(
        prog="grimoire generate",
        description="Complete a prompt with a saved model (a full model or a LoRA adapter "
        "folder). Prints the completion only.",
    )
    p.add_argument("--model", required=True, help="model folder, or a LoRA adapter folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="seed for sampling (reproducible output)")
    p.add_argument("--num-return-sequences", type=int, default=1)
    p.add_argument("--base", help="base model for an adapter folder (default: its config's)")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")

    def body() -> int:
        import torch

        args = p.parse_args(list(argv))
        problems = sampling_problems(
            args.max_new_tokens, args.temperature, args.top_p, args.num_return_sequences
        )
        if problems:  # before the (possibly slow) model load
            raise GrimoireError("; ".join(problems))
        model, tokenizer, _ = load_for_inference(args.model, args.base, args.dtype)
        model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        texts = generate(
            model,
            tokenizer,
            args.prompt,
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            num_return_sequences=args.num_return_sequences,
        )
        for i, text in enumerate(texts):
            if len(texts) > 1:  # completions may span lines: mark where each one starts
                print(f"--- {i + 1}/{len(texts)} ---")
            print(text)
        return 0

    return run_tool("generate", body)
