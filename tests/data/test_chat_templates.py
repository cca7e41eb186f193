"""Assistant-only labels under every stock chat template TRL ships (read from the installed
``trl`` package): the template x conversation table of docs/chat-templates.md, computed here.

A cell is ``equal`` (a template with ``{% generation %}`` blocks: grimoire's labels equal the
mask transformers returns, token for token, and pass the independent check below), ``labelled``
(every assistant answer, its rendered reasoning and tool call, and the token closing its turn
labelled; nothing of the system, user or tool texts), or ``refused`` with the reason. A wrong
label anywhere fails the test.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.helpers.chat_templates import (
    as_parts,
    bpe_tokenizer,
    cell,
    char_tokenizer,
    check_labels,
    conversations,
    eos_cell,
    expected_row,
    rendering,
    stock_templates,
    template_dir,
)

from grimoire.data import tokenize_kto, tokenize_preference, tokenize_sft
from grimoire.errors import DataError
from grimoire.rows.chat import answer_and_reasoning

DOC = Path(__file__).resolve().parents[2] / "docs" / "chat-templates.md"
BEGIN, END = "<!-- table: begin -->", "<!-- table: end -->"


def build_table() -> tuple[str, dict[str, dict[str, str]], dict[str, str]]:
    """The docs table, its conversation cells (template -> kind -> cell) and its EOS column
    (template -> what ``tokenize_sft`` writes after a one-turn conversation's answer)."""
    kinds = conversations()
    cells = {
        path.stem: {kind: cell(path, messages, tools) for kind, (messages, tools) in kinds.items()}
        for path in stock_templates()
    }
    eos = {path.stem: eos_cell(path) for path in stock_templates()}
    lines = [
        "| template | " + " | ".join(kinds) + " | EOS after the final turn |",
        "|---|" + "---|" * (len(kinds) + 1),
    ]
    for name, row in cells.items():
        lines.append(
            f"| `{name}` | "
            + " | ".join(c.replace("|", "\\|") for c in [*row.values(), eos[name]])
            + " |"
        )
    return "\n".join(lines), cells, eos


@pytest.fixture(scope="module")
def table():
    return build_table()


def test_no_template_gets_a_wrong_label(table):
    text, cells, _ = table
    print("\n" + text)
    wrong = [f"{t} / {k}: {c}" for t, row in cells.items() for k, c in row.items() if "WRONG" in c]
    assert not wrong, "\n".join(wrong)


def test_every_training_template_matches_transformers_mask_token_for_token(table):
    _, cells, _ = table
    training = [t for t in cells if t.endswith("_training")]
    assert len(training) >= 30
    # A training template matches when every conversation it renders is "equal"; the ones it
    # refuses are refused by the template itself (or drop a tool call, see the docs).
    matched = [
        t
        for t in training
        if all(c.startswith(("equal", "refused")) for c in cells[t].values())
        and any(c.startswith("equal") for c in cells[t].values())
    ]
    print(f"\n{len(matched)} of {len(training)} training templates match transformers' mask")
    assert matched == training


def test_the_prefix_unstable_templates_of_the_issue_are_labelled(table):
    # Qwen3 drops earlier reasoning, Phi-3 and gpt-oss change the final turn, DeepSeek's
    # generation prompt differs from its rendered turns: all were refused or silently wrong.
    _, cells, _ = table
    for name in (
        "qwen3",
        "qwen3_5_think",
        "qwen3_5_nothink",
        "qwen3_6",
        "phi3",
        "phi3_5",
        "gptoss",
        "deepseekv3",
        "deepseek_r1_distill",
    ):
        for kind in ("plain", "3-turn", "reasoning"):
            assert cells[name][kind] == "labelled", (name, kind, cells[name][kind])
    # Tool-call turns that close with their own token (gpt-oss <|call|>, Gemma 4
    # <|tool_response>) or share their turn with the tool result (Gemma 4).
    for name in ("gptoss", "gemma4", "glm4moe", "qwen3", "qwen3_5_think", "llama3_1"):
        assert cells[name]["tool-call"] == "labelled", (name, cells[name]["tool-call"])


@pytest.mark.parametrize(
    "name",
    [
        "qwen3",
        "qwen2_5",
        "llama3_1",
        "deepseekv3",
        "deepseek_r1_distill",
        "phi3",
        "gptoss",
        "gemma3",
        "glm4moe",
        "qwen3_training",
        "llama3_training",
        "gptoss_training",
    ],
)
def test_merging_bpe_tokens_get_the_same_cells(table, name):
    # A byte-level BPE merges a space with the next word and letters into words, so token edges
    # no longer fall on every character: the cells must not change (in particular, no WRONG).
    _, cells, eos = table
    path = template_dir() / f"{name}.jinja"
    tokenizer = bpe_tokenizer(path.read_text())
    got = {
        kind: cell(path, messages, tools, tokenizer)
        for kind, (messages, tools) in conversations().items()
    }
    assert got == cells[name]
    assert eos_cell(path, tokenizer) == eos[name]


def test_docs_table_is_the_computed_one(table):
    text, _, _ = table
    doc = DOC.read_text()
    if os.environ.get("GRIMOIRE_WRITE_TABLE"):
        doc = re.sub(
            re.escape(BEGIN) + ".*?" + re.escape(END),
            lambda _: f"{BEGIN}\n{text}\n{END}",
            doc,
            flags=re.S,
        )
        DOC.write_text(doc)
    assert f"{BEGIN}\n{text}\n{END}" in doc, "run with GRIMOIRE_WRITE_TABLE=1 to refresh the docs"


def test_eos_follows_a_final_turn_only_where_the_template_leaves_it_open(table):
    # Issue 44: EOS was appended after every template's own end of turn (under SmolLM2's
    # ChatML tokenizer a row ended <|im_end|>\n<|im_end|>). Now a chat row is the template's
    # rendering; of TRL's stock templates only GLM-4-MoE's writes nothing after the final
    # answer, so only its rows get EOS. Phi-3 writes the EOS itself: not doubled either.
    _, _, eos = table
    assert not {t: c for t, c in eos.items() if not c.startswith(("none", "appended"))}
    assert sorted(t for t, c in eos.items() if c.startswith("appended")) == ["glm4moe"]
    assert eos["phi3"] == "none (closed by `<|end|>\\n<eos>`)"
    assert eos["qwen2_5"] == "none (closed by `<|im_end|>\\n`)"


@pytest.mark.parametrize("path", stock_templates(), ids=lambda p: p.stem)
def test_chat_rows_are_the_template_rendering_with_no_extra_eos_under_every_template(path):
    # Every conversation of the table the row is not refused on: input_ids are the template's
    # own tokenization token for token, EOS (trained) after it only where the template leaves
    # the final turn open; labels on assistant turns only. The same conversation as a
    # conversational prompt-completion row gives the same tokens, only the completion trained.
    tokenizer = char_tokenizer(path.read_text())
    eos, checked = tokenizer.eos_token_id, 0
    for kind, (messages, tools) in conversations().items():
        placed = rendering(tokenizer, messages, tools)
        if placed is None:
            continue  # the template raises (the table's "refused")
        messages, _ = placed
        try:
            out = tokenize_sft({"messages": messages, "tools": tools}, tokenizer, 10_000)
        except DataError:
            continue  # refused with the reason in the table
        expected, is_open = expected_row(tokenizer, messages, tools)
        assert out["input_ids"] == expected, kind
        n = len(expected) - is_open
        assert check_labels(tokenizer, messages, tools, out["labels"][:n]) == [], kind
        assert out["labels"][n:] == [eos] * is_open, kind
        row = {"prompt": messages[:-1], "completion": messages[-1:], "tools": tools}
        pc = tokenize_sft(row, tokenizer, 10_000)
        start = next(i for i, t in enumerate(pc["labels"]) if t != -100)
        assert pc["input_ids"] == expected, kind
        assert pc["labels"][start:] == out["labels"][start:], kind
        trained = "".join(tokenizer.convert_ids_to_tokens(pc["input_ids"][start:]))
        earlier = [answer_and_reasoning(m)[0] for m in messages[:-1] if m["role"] == "assistant"]
        assert not any(a and a in trained for a in earlier), kind
        checked += 1
    assert checked


@pytest.mark.parametrize("path", stock_templates(), ids=lambda p: p.stem)
def test_preference_and_kto_rows_train_only_their_responses_with_no_extra_eos(path):
    # A multi-turn prompt (its assistant turn is context) and two one-turn responses: the
    # response split comes from one rendering of each whole conversation, and each side is
    # that rendering token for token (EOS after it only where the template leaves it open).
    tokenizer = char_tokenizer(path.read_text())
    prompt = [
        {"role": "user", "content": "userquestion one"},
        {"role": "assistant", "content": "assistantanswer alpha"},
        {"role": "user", "content": "userquestion two"},
    ]
    chosen = [{"role": "assistant", "content": "chosenreply good"}]
    rejected = [{"role": "assistant", "content": "rejectedreply bad"}]
    try:
        out = tokenize_preference(
            {"prompt": prompt, "chosen": chosen, "rejected": rejected}, tokenizer, 10_000
        )
    except Exception:  # the vision-language templates read content parts only
        row = {
            "prompt": as_parts(prompt),
            "chosen": as_parts(chosen),
            "rejected": as_parts(rejected),
        }
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        out = tokenize_preference(row, tokenizer, 10_000)
    for side, reply in (("chosen", "chosenreply good"), ("rejected", "rejectedreply bad")):
        labels = out[f"{side}_labels"]
        trained = "".join(tokenizer.convert_ids_to_tokens([t for t in labels if t != -100]))
        assert reply in trained and "alpha" not in trained and "question" not in trained
    n = next(i for i, t in enumerate(out["chosen_labels"]) if t != -100)
    assert out["chosen_input_ids"][:n] == out["rejected_input_ids"][:n]
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        expected, is_open = expected_row(tokenizer, prompt + response)
        assert out[f"{side}_input_ids"] == expected
        if is_open:  # the appended EOS is trained (Phi-3 writes and trains its own)
            assert out[f"{side}_labels"][-1] == tokenizer.eos_token_id
    kto = tokenize_kto({"prompt": prompt, "completion": chosen, "label": True}, tokenizer, 10_000)
    assert kto["input_ids"] == out["chosen_input_ids"]
    assert kto["labels"] == out["chosen_labels"]
