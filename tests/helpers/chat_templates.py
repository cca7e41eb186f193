"""TRL's stock chat templates (read from the installed ``trl`` package, never copied) on a
character-level tokenizer that carries each template's special tokens, and the checks that
decide each cell of the template x conversation table in docs/chat-templates.md."""

from __future__ import annotations

import re
import string
from pathlib import Path

from grimoire.columns import IGNORE_INDEX
from grimoire.errors import DataError
from grimoire.rows.chat import answer_and_reasoning, chat_labels, has_generation_blocks
from grimoire.rows.rendering import render_text

_SPECIAL = re.compile(
    r"<[|｜][^<>\s'\"{}]{1,40}?[|｜]?>|<[|｜]?[a-z_]{2,30}[|｜]>|<(?:start|end)_of_\w+>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "getweather",
            "description": "weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "getweather", "arguments": {"city": "zurichcity"}}}


def conversations() -> dict[str, tuple[list[dict], list | None]]:
    """The conversation kinds of the table: ``name -> (messages, tools)``. Every text is unique
    and no text contains another, so a plain ``str.find`` places each in a rendering."""
    sys_ = {"role": "system", "content": "systemtext kappa"}
    u = [{"role": "user", "content": f"userquestion {w}"} for w in ("one", "two", "three")]
    a = [
        {"role": "assistant", "content": f"assistantanswer {w}"} for w in ("alpha", "beta", "gamma")
    ]
    think = [
        {"role": "assistant", "content": "finalanswer delta", "reasoning_content": "firstthought"},
        {"role": "assistant", "content": "finalanswer omega", "reasoning_content": "lastthought"},
    ]
    return {
        "plain": ([sys_, u[0], a[0], u[1], a[1]], None),
        "system-less": ([u[0], a[0], u[1], a[1]], None),
        "1-turn": ([u[0], a[0]], None),
        "3-turn": ([sys_, u[0], a[0], u[1], a[1], u[2], a[2]], None),
        "tool-call": (
            [
                u[0],
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "name": "getweather", "content": "toolresult sunny"},
                a[1],
            ],
            TOOLS,
        ),
        "reasoning": ([u[0], think[0], u[1], think[1]], None),
    }


def template_dir() -> Path:
    import trl

    return Path(trl.__file__).resolve().parent / "chat_templates"


def stock_templates() -> list[Path]:
    return sorted(template_dir().glob("*.jinja"))


def _fast_tokenizer(tok, template: str):
    """``tok`` as a transformers fast tokenizer with the tiny models' four special tokens and
    ``template`` as its chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    hf.chat_template = template
    return hf


def char_tokenizer(template: str):
    """A character-level fast tokenizer whose added tokens are ``template``'s special tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = sorted(set(_SPECIAL.findall(template)) | {"<bos>", "<eos>", "<pad>", "<unk>"})
    chars = set(string.printable) | set(template)
    vocab: dict[str, int] = {}
    for tok in [*specials, *sorted(chars)]:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.add_special_tokens(specials)
    return _fast_tokenizer(tok, template)


def _labelled_chars(tokenizer, text: str, labels: list[int]) -> list[bool]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert len(enc["input_ids"]) == len(labels), "labels do not match one rendering of the text"
    on = [False] * len(text)
    for (begin, end), label in zip(enc["offset_mapping"], labels):
        for c in range(begin, end):
            on[c] = label != IGNORE_INDEX
    return on


def check_labels(tokenizer, messages, tools, labels) -> list[str]:
    """Independent check of one row's labels: every assistant answer (and its tool call, and
    the token closing the turn) labelled; nothing of the system, user or tool texts labelled."""
    text = render_text(tokenizer, messages, tools=tools)
    on = _labelled_chars(tokenizer, text, labels)
    problems, cursor = [], 0
    for i, m in enumerate(messages):
        role = m["role"]
        answer = answer_and_reasoning(m)[0]
        if role == "assistant" and not answer:
            answer = '"zurichcity"' if '"zurichcity"' in text[cursor:] else "zurichcity"
        at = text.find(answer, cursor)
        if at < 0:
            if role == "assistant":
                problems.append(f"message {i}: answer not rendered")
            continue
        span = on[at : at + len(answer)]
        reasoning = answer_and_reasoning(m)[1] if role == "assistant" else ""
        r = text.find(reasoning, cursor) if reasoning else -1
        if 0 <= r < at and not all(on[r : r + len(reasoning)]):
            problems.append(f"message {i}: its rendered reasoning is not labelled")
        if role == "assistant":
            if not all(span):
                problems.append(f"message {i}: answer not fully labelled")
            rest = len(text[at + len(answer) :]) - len(text[at + len(answer) :].lstrip())
            after = at + len(answer) + rest
            if after < len(text) and not on[after]:
                problems.append(f"message {i}: the token closing the turn is not labelled")
        elif any(span):
            problems.append(f"message {i} ({role}): text labelled")
        cursor = at + len(answer)
    return problems


def as_parts(messages: list[dict]) -> list[dict]:
    """``messages`` with string contents as ``[{"type": "text", "text": ...}]`` parts (what the
    vision-language templates iterate over)."""
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]}
        if isinstance(m.get("content"), str) and m["content"]
        else m
        for m in messages
    ]


def bpe_tokenizer(template: str, vocab_size: int = 400):
    """A byte-level BPE fast tokenizer trained in code on this module's conversations rendered
    with ``template``, carrying its special tokens: its tokens merge characters (a space with
    the next word, several letters), unlike :func:`char_tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    char = char_tokenizer(template)
    corpus = []
    for messages, tools in conversations().values():
        for form in (messages, as_parts(messages)):
            try:
                corpus.append(render_text(char, form, tools=tools))
            except Exception:
                continue  # the template refuses this conversation: nothing to learn from
    specials = sorted(char.get_added_vocab())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus * 3, trainer)
    return _fast_tokenizer(tok, template)


def rendering(tokenizer, messages, tools=None) -> tuple[list, str] | None:
    """``(messages, text)``: the conversation as the template renders it (as text parts for the
    vision-language templates), or ``None`` where the template raises or drops an answer."""
    answers = [answer_and_reasoning(m)[0] for m in messages if m["role"] == "assistant"]
    for form in (messages, as_parts(messages)):
        try:
            text = render_text(tokenizer, form, tools=tools)
        except Exception:
            continue
        if all(a in text for a in answers if a):
            return form, text
    return None


def leaves_final_turn_open(text: str, messages) -> bool:
    """The independent rule of the EOS tests: the template writes nothing but whitespace after
    the final assistant answer."""
    answer = answer_and_reasoning(messages[-1])[0]
    return (
        messages[-1]["role"] == "assistant"
        and not text[text.rindex(answer) + len(answer) :].strip()
    )


def expected_row(tokenizer, messages, tools=None) -> tuple[list[int], bool]:
    """``(input_ids, open)`` a chat row must have: the template's own tokenization
    (``apply_chat_template(tokenize=True)``), plus EOS only where it leaves the final turn open."""
    kwargs = {"tools": tools} if tools else {}
    ids = list(
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)[
            "input_ids"
        ]
    )
    text = render_text(tokenizer, messages, tools=tools)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    is_open = leaves_final_turn_open(text, messages)
    return ids + [tokenizer.eos_token_id] * is_open, is_open


def eos_cell(path: Path, tokenizer=None) -> str:
    """The table's EOS cell: what ``tokenize_sft`` writes after a one-turn conversation's
    answer: nothing but the template's own closing, or EOS where the template leaves the final
    turn open. ``WRONG: ...`` is a bug."""
    from grimoire.rows.sft import tokenize_sft

    tokenizer = tokenizer or char_tokenizer(path.read_text())
    placed = rendering(tokenizer, conversations()["1-turn"][0])
    if placed is None:
        return "refused"
    messages, text = placed
    expected, is_open = expected_row(tokenizer, messages)
    ids = tokenize_sft({"messages": messages}, tokenizer, max_length=10_000)["input_ids"]
    if ids != expected:
        return "WRONG: the row is not the template's rendering" + " + EOS" * is_open
    tail = text[text.rindex("assistantanswer alpha") + len("assistantanswer alpha") :]
    if is_open:
        return "appended (the final turn is left open)"
    return "none (closed by `" + tail.replace("\n", "\\n") + "`)"


def cell(path: Path, messages, tools, tokenizer=None) -> str:
    """One table cell: ``equal``, ``labelled`` or ``refused: reason``; ``WRONG: ...`` is a bug.

    A template that renders no plain-string content (the vision-language ones) is given the same
    conversation as text parts, and the cell says so."""
    tokenizer = tokenizer or char_tokenizer(path.read_text())
    first = _cell(tokenizer, messages, tools)
    if first.startswith("refused"):
        second = _cell(tokenizer, as_parts(messages), tools)
        return first if second.startswith("refused") else second + " (text parts)"
    return first


def _cell(tokenizer, messages, tools) -> str:
    template = tokenizer.chat_template
    try:
        render_text(tokenizer, messages, tools=tools)
    except Exception as exc:
        if isinstance(exc, DataError):
            raise
        return f"refused: the template raises '{str(exc).splitlines()[0][:50]}'"
    try:
        _, labels = chat_labels(tokenizer, messages, tools=tools)
    except DataError as exc:
        return f"refused: {exc.problems[0]}"
    problems = check_labels(tokenizer, messages, tools, labels)
    if has_generation_blocks(template):
        enc = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        mask = enc["assistant_masks"]
        expected = [t if on else IGNORE_INDEX for t, on in zip(enc["input_ids"], mask)]
        if labels != expected:
            return "WRONG: labels differ from transformers' assistant mask"
        if problems:
            return "WRONG (the template's own mask): " + "; ".join(problems)
        return "equal"
    if problems:
        return "WRONG: " + "; ".join(problems)
    return "labelled"
