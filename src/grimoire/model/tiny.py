"""Tiny models, a character-level tokenizer and toy tasks, all built in code (no downloads).

They back the quickstart demo, the tests and the benchmarks: the real ``from_pretrained`` /
``save_pretrained`` paths are exercised on them, so nothing here is a mock.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<unk>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CHARS = string.ascii_lowercase + string.digits + " \n+-=*?:.,>!()'\"_/"
#: The tiny tokenizer's chat template: every turn is ``<|role|>content<|end|>``; the generation
#: prompt is ``<|assistant|>``. An assistant turn writes its ``reasoning_content`` first
#: (``think: ...`` and a newline) and its ``tool_calls`` after the content
#: (``call: name(key=value, ...)``, in the tokenizer's characters); ``tools`` are listed in a
#: leading system turn; a ``tool`` result is a user turn ``<|user|>result: ...<|end|>`` (the
#: vocabulary has no tool role token). Plain conversations render as ``<|role|>content<|end|>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|user|>result: {% else %}<|{{ m['role'] }}|>{% endif %}"
    "{% if m['reasoning_content'] %}think: {{ m['reasoning_content'] }}\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}call: {{ c['function']['name'] }}("
    "{% set args = c['function']['arguments'] %}"
    "{% if args is string %}{{ args }}{% else %}"
    "{% for k, v in args.items() %}{{ k }}={{ v }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "{% endif %}){% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ASSETS = Path(__file__).resolve().parent.parent / "assets"


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with BOS/EOS/PAD and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_config(
    arch: str = "llama",
    vocab_size: int = 64,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie_word_embeddings: bool = True,
    **overrides: Any,
):
    """A small random-init config of ``arch`` ("llama", "qwen2" or "gemma2")."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "gemma2":
        common.update(
            head_dim=hidden_size // 4, final_logit_softcapping=30.0, query_pre_attn_scalar=16
        )
        common.update(sliding_window=64)
    common.update(overrides)
    return AutoConfig.for_model(arch, **common)


def build_model(arch: str = "llama", seed: int = 0, **config_kwargs: Any):
    """A random-init tiny causal LM (fp32; sdpa attention, eager for Gemma-2)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **config_kwargs)
    # Gemma-2's attention softcapping has no sdpa kernel in transformers; eager is exact.
    attn = "eager" if arch == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def save_tiny(path: str | Path, arch: str = "llama", seed: int = 0, **config_kwargs: Any) -> Path:
    """Write a tiny model and its tokenizer with ``save_pretrained`` so ``from_pretrained`` works."""
    path = Path(path)
    tokenizer = build_tokenizer()
    config_kwargs.setdefault("vocab_size", _round_up(len(tokenizer), 8))
    build_model(arch, seed=seed, **config_kwargs).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


# --------------------------------------------------------------------------- toy tasks


# task -> (seed offset, answer). The offsets keep each task's word stream apart for one seed.
LETTER_TASKS: dict[str, tuple[int, Callable[[str], str]]] = {
    "reverse": (0, lambda w: w[::-1]),
    "first": (30_000, lambda w: w[0]),
    "copy": (40_000, lambda w: w),
}


def letter_rows(
    task: str,
    n: int,
    seed: int,
    min_len: int = 3,
    max_len: int = 6,
    letters: str = string.ascii_lowercase[:12],
) -> list[dict[str, str]]:
    """``{task} {word}=`` -> answer, for random words over ``letters`` (default a-l).

    ``reverse abc=`` -> ``cba``; ``first abc=`` -> ``a``; ``copy abc=`` -> ``abc``. Exact-match
    checkable, and chance accuracy is ~0 for reverse and copy. Continual-learning experiments
    pick ``letters`` per task, e.g. ``"mnopqrstuvwx"`` for letters another task never used.
    """
    offset, answer = LETTER_TASKS[task]
    rng = random.Random(seed + offset)
    rows = []
    for _ in range(n):
        word = "".join(rng.choices(letters, k=rng.randint(min_len, max_len)))
        out = answer(word)
        rows.append({"prompt": f"{task} {word}=", "response": out, "answer": out})
    return rows


reverse_rows = partial(letter_rows, "reverse")
first_letter_rows = partial(letter_rows, "first")
copy_rows = partial(letter_rows, "copy")


def corrupt(text: str, rng: random.Random) -> str:
    """A wrong answer close to the right one (a swapped or replaced character)."""
    chars = list(text)
    i = rng.randrange(len(chars))
    choices = [c for c in string.ascii_lowercase[:12] if c != chars[i]]
    chars[i] = rng.choice(choices)
    return "".join(chars)


def preference_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Prompt / chosen (correct) / rejected (corrupted) triples on the reverse task."""
    rng = random.Random(seed + 1)
    return [
        {"prompt": r["prompt"], "chosen": r["response"], "rejected": corrupt(r["response"], rng)}
        for r in reverse_rows(n, seed)
    ]


def kto_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Unpaired prompt / completion / label rows: half correct (True), half corrupted (False)."""
    rng = random.Random(seed + 2)
    out = []
    for i, r in enumerate(reverse_rows(n, seed)):
        good = i % 2 == 0
        completion = r["response"] if good else corrupt(r["response"], rng)
        out.append({"prompt": r["prompt"], "completion": completion, "label": good})
    return out


def reverse_chat_rows(n: int, seed: int, turns: int = 3) -> list[dict[str, Any]]:
    """Multi-turn chats of the reverse task: a system turn, then ``turns`` user questions each
    answered by the assistant (``{"messages": [...]}`` rows for the chat template)."""
    words = reverse_rows(n * turns, seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "reverse each word."}]
        for r in words[i * turns : (i + 1) * turns]:
            messages += [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ]
        rows.append({"messages": messages})
    return rows


def lookup(word: str) -> str:
    """The reverse of a word.

    Args:
        word: the word to look up
    """
    return word[::-1]


#: :func:`lookup`'s tool schema, as ``transformers.utils.get_json_schema`` builds it (the chat
#: template's ``tools``); written out so the rows below need no transformers.
LOOKUP_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The reverse of a word.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "description": "the word to look up"}},
            "required": ["word"],
        },
        "return": {"type": "string"},
    },
}


def lookup_chat_rows(
    n: int, seed: int, direct_share: float = 0.0, **words: Any
) -> list[dict[str, Any]]:
    """The reverse task answered with the :func:`lookup` tool, as SFT chat rows: the user asks
    ``reverse abc=``, the assistant calls ``lookup(word=abc)``, the tool answers ``cba``, the
    assistant answers ``cba`` (``{"messages", "tools"}`` rows; a warm start for tool-using RL).

    ``direct_share`` of the rows (drawn per row from ``seed``) answer at once, without the tool,
    under the same prompt and tool list: a model trained on the mix calls the tool on about
    ``1 - direct_share`` of its episodes, and since the tiny model reverses poorly on its own,
    calling pays, which gives RL a dense signal to learn from (``lookup_warm``). ``words``
    (``min_len``, ``max_len``, ``letters``) go to :func:`letter_rows`."""
    pick = random.Random(seed + 50_000)
    rows = []
    for r in reverse_rows(n, seed, **words):
        word = r["prompt"][len("reverse ") : -1]
        call = {"type": "function", "function": {"name": "lookup", "arguments": {"word": word}}}
        messages: list[dict[str, Any]] = [{"role": "user", "content": r["prompt"]}]
        if pick.random() >= direct_share:
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "lookup", "content": lookup(word)},
            ]
        messages.append({"role": "assistant", "content": r["answer"]})
        rows.append({"messages": messages, "tools": [LOOKUP_SCHEMA]})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_assets(folder: Path = ASSETS) -> None:
    """Regenerate the bundled toy datasets (deterministic)."""
    write_jsonl(reverse_rows(2000, seed=0), folder / "reverse_train.jsonl")
    write_jsonl(reverse_rows(200, seed=1), folder / "reverse_eval.jsonl")
    write_jsonl(reverse_chat_rows(500, seed=2), folder / "reverse_chat.jsonl")
    # The tool task's words are longer than the reverse task's: the tiny model copies a tool's
    # answer of 6-10 letters far more reliably than it reverses one, so calling the tool pays.
    write_jsonl(
        lookup_chat_rows(2000, seed=3, direct_share=0.5, min_len=6, max_len=10),
        folder / "lookup_train.jsonl",
    )
    write_jsonl(reverse_rows(2000, seed=4, min_len=6, max_len=10), folder / "lookup_prompts.jsonl")
    write_jsonl(reverse_rows(200, seed=5, min_len=6, max_len=10), folder / "lookup_eval.jsonl")


if __name__ == "__main__":
    write_assets()
