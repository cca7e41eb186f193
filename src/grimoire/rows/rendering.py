"""How a chat template renders: the conversation to text (``render_text``), and what the
template writes around an assistant turn (``template_shape``: its header and the texts that close
a turn), learnt once per template from tiny probe conversations and cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grimoire.errors import DataError

Messages = list[dict[str, Any]]
_PROBE = ("grimoireprobeuser", "grimoireprobeanswer", "grimoireprobenext")


@dataclass(frozen=True)
class TemplateShape:
    """What a template writes around an assistant turn, learnt from one probe conversation."""

    header: str  # the generation prompt (text add_generation_prompt appends); "" if unknown
    header_min: int  # the length of the header's first token: the least of it that must match
    closings: tuple[str, ...]  # texts that close an assistant turn (middle turn, final turn)
    tool_closings: tuple[str, ...] = ()  # texts that close a turn of tool calls (gpt-oss: <|call|>)


_SHAPES: dict[tuple[str, str | None, str | None], TemplateShape] = {}


def render_text(
    tokenizer, messages: Messages, *, tools: Sequence[Any] | None = None, generation: bool = False
) -> str:
    """``messages`` rendered to text with the tokenizer's chat template (``tools`` passed)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            [
                "the tokenizer has no chat_template; set tokenizer.chat_template or use "
                "prompt/response fields"
            ]
        )
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, **kwargs
    )


def _token_prefix(tokenizer, text: str, limit: str) -> str:
    """The longest run of ``text``'s leading tokens that is a prefix of ``limit``."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    end = 0
    for _, stop in enc["offset_mapping"]:
        if not limit.startswith(text[:stop]):
            break
        end = stop
    if end == 0 and enc["offset_mapping"]:
        # No shared prefix (gpt-oss ends middle turns with <|end|>, the last with <|return|>):
        # the first token closes the turn when it is one of the tokenizer's special tokens.
        first = text[: enc["offset_mapping"][0][1]]
        if first in set(getattr(tokenizer, "all_special_tokens", ())) | set(
            tokenizer.get_added_vocab()
        ):
            end = len(first)
    return text[:end]


def _probe(tokenizer, parts: bool) -> tuple[str, list[str]]:
    """``(header, closings)`` from rendering a two- and a three-message probe conversation."""
    user, answer, nxt = _PROBE

    def msg(role: str, text: str) -> dict[str, Any]:
        return {"role": role, "content": [{"type": "text", "text": text}] if parts else text}

    one = [msg("user", user)]
    two = [*one, msg("assistant", answer)]
    bare, prompted = render_text(tokenizer, one), render_text(tokenizer, one, generation=True)
    header = prompted[len(bare) :] if prompted.startswith(bare) else ""
    final = render_text(tokenizer, two)
    final = final[final.rindex(answer) + len(answer) :]
    middle = render_text(tokenizer, [*two, msg("user", nxt)])
    at = middle.index(answer) + len(answer)
    middle = middle[at : middle.index(nxt, at)]
    return header, [_token_prefix(tokenizer, middle, final), final]


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "grimoireprobetool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}


def _probe_tool_closings(tokenizer) -> list[str]:
    """What closes an assistant turn of tool calls: the text after the call's last argument in
    a rendering that ends with it, and that text from its first ``<`` (the argument's own
    quotes and braces depend on the arguments)."""
    value = "grimoireprobearg"
    call = {
        "type": "function",
        "function": {"name": "grimoireprobetool", "arguments": {"x": value}},
    }
    messages = [
        {"role": "user", "content": _PROBE[0]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    try:
        text = render_text(tokenizer, messages, tools=[_PROBE_TOOL])
    except Exception:
        return []  # a template without tool calls
    if value not in text:
        return []
    tail = text[text.rindex(value) + len(value) :]
    return [tail, tail[tail.find("<") :] if "<" in tail else ""]


def template_shape(tokenizer) -> TemplateShape:
    """The template's assistant header and turn closings (cached per template)."""
    key = (tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    if key in _SHAPES:
        return _SHAPES[key]
    header, closings = "", []
    for parts in (False, True):  # vision-language templates render only text parts
        try:
            header, closings = _probe(tokenizer, parts)
            break
        except Exception:
            continue  # a template that refuses the probe conversation just has no shape
    first = tokenizer(header, add_special_tokens=False, return_offsets_mapping=True)
    header_min = min(
        (stop for _, stop in first["offset_mapping"] if header[:stop].strip()), default=0
    )
    tool_closings = _probe_tool_closings(tokenizer)
    shape = TemplateShape(
        header,
        header_min,
        tuple(dict.fromkeys(c for c in closings if c.strip())),
        tuple(dict.fromkeys(c for c in tool_closings if c.strip())),
    )
    _SHAPES[key] = shape
    return shape


__all__ = ["TemplateShape", "render_text", "template_shape"]
