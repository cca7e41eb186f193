"""``grimoire generate``: complete one prompt with a saved model and print the completion(s).

Usage::

    grimoire generate --model out/final --prompt "reverse abcdef=" [--chat] [--temperature 0.7]

``--model`` is a full model folder, a saved LoRA adapter folder (loaded onto its base), or a
``.gguf`` file / ``grimoire://models/<name>`` (converted once and cached).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grimoire.columns import pad_token_id_of
from grimoire.errors import GrimoireError
from grimoire.rollout.engines.generation import encode_prompt, generation_mode
from grimoire.tools.common import DTYPES, ToolParser, load_for_inference, run_tool


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
    pad = pad_token_id_of(tokenizer, model)
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


def main(argv: Sequence[str]) -> int:
    """``grimoire generate``: print the completion(s) of one prompt; returns the exit code."""
    p = ToolParser(
        prog="grimoire generate",
        description="Complete a prompt with a saved model (a full model or a LoRA adapter "
        "folder). Prints the completion only.",
    )
    p.add_argument(
        "--model", required=True, help="model folder, LoRA adapter folder, or .gguf file"
    )
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


__all__ = ["generate", "main", "sampling_problems"]
