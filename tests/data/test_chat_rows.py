"""Chat rows end to end under a real template (TRL's stock Qwen3 template, read from the
installed ``trl`` package, on a character tokenizer): tool calls trained and tool results
never, the last turn's reasoning on or off, SFT / preference / KTO alike; truncation counted;
bad conversations reported with file:line in one message. The expected trained texts are the
template's own rendering of the assistant turns, written out by hand."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("trl")

from tests.helpers.chat_templates import TOOLS, char_tokenizer, conversations, template_dir

from grimoire.data import (
    tokenize_dataset,
    tokenize_grpo,
    tokenize_kto,
    tokenize_preference,
    tokenize_sft,
)
from grimoire.errors import DataError
from grimoire.rows.common import counting_cuts
from grimoire.rows.sources import read_source

CALL_TEXT = (
    '<tool_call>\n{"name": "getweather", "arguments": {"city": "zurichcity"}}\n</tool_call>'
    "<|im_end|>\n"
)


@pytest.fixture(scope="module")
def qwen3():
    return char_tokenizer((template_dir() / "qwen3.jinja").read_text())


def trained(tok, labels):
    return "".join(tok.convert_ids_to_tokens([t for t in labels if t != -100]))


def test_sft_trains_the_tool_call_and_the_answer_never_the_tool_result(qwen3):
    messages, tools = conversations()["tool-call"]
    out = tokenize_sft({"messages": messages, "tools": json.dumps(tools)}, qwen3)
    expected = CALL_TEXT + "<think>\n\n</think>\n\nassistantanswer beta<|im_end|>\n"
    assert trained(qwen3, out["labels"]) == expected
    assert "toolresult" in "".join(qwen3.convert_ids_to_tokens(out["input_ids"]))


def test_final_reasoning_is_trained_by_default_and_can_be_left_out(qwen3):
    messages, _ = conversations()["reasoning"]
    # Qwen3 drops the first turn's reasoning (before the last user message) from the input.
    on = tokenize_sft({"messages": messages}, qwen3)
    assert trained(qwen3, on["labels"]) == (
        "finalanswer delta<|im_end|>\n<think>\nlastthought\n</think>\n\n"
        "finalanswer omega<|im_end|>\n"
    )
    off = tokenize_sft({"messages": messages}, qwen3, train_final_reasoning=False)
    assert off["input_ids"] == on["input_ids"]
    assert trained(qwen3, off["labels"]) == (
        "finalanswer delta<|im_end|>\nfinalanswer omega<|im_end|>\n"
    )


@pytest.mark.parametrize("result", ["zurichcity", "zurich", "3"])
def test_sft_labels_a_tool_call_whose_result_repeats_its_argument(qwen3, result):
    # The tool's answer appears inside the call's arguments: it must still be placed after the
    # call's turn, so the call is trained and the answer is not.
    arguments = {"city": "zurichcity", "days": 3}
    call = {"type": "function", "function": {"name": "getweather", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "userquestion one"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "getweather", "content": result},
        {"role": "assistant", "content": "assistantanswer beta"},
    ]
    out = tokenize_sft({"messages": messages, "tools": TOOLS}, qwen3)
    call_text = CALL_TEXT.replace('"zurichcity"}', '"zurichcity", "days": 3}')
    expected = call_text + "<think>\n\n</think>\n\nassistantanswer beta<|im_end|>\n"
    assert trained(qwen3, out["labels"]) == expected


def test_preference_and_kto_train_tool_calls_with_the_prompt_shared(qwen3):
    prompt = [{"role": "user", "content": "userquestion one"}]
    call = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": conversations()["tool-call"][0][1]["tool_calls"],
        }
    ]
    answer = [{"role": "assistant", "content": "assistantanswer beta"}]
    row = {"prompt": prompt, "chosen": call, "rejected": answer, "tools": TOOLS}
    out = tokenize_preference(row, qwen3)
    # Qwen3 writes an empty thinking block into the final assistant turn.
    think = "<think>\n\n</think>\n\n"
    assert trained(qwen3, out["chosen_labels"]) == think + CALL_TEXT
    assert trained(qwen3, out["rejected_labels"]) == think + "assistantanswer beta<|im_end|>\n"
    n = out["chosen_labels"].index(next(t for t in out["chosen_labels"] if t != -100))
    assert out["chosen_input_ids"][:n] == out["rejected_input_ids"][:n]
    kto = tokenize_kto({"prompt": prompt, "completion": call, "label": True}, qwen3, tools=TOOLS)
    assert trained(qwen3, kto["labels"]) == think + CALL_TEXT


def test_turn_truncation_keeps_whole_turns_and_the_cut_is_logged(qwen3, caplog):
    messages, _ = conversations()["3-turn"]
    full = tokenize_sft({"messages": messages}, qwen3, max_length=10_000)
    limit = len(full["input_ids"]) - 5  # the last turn no longer fits
    with counting_cuts() as cut:
        out = tokenize_sft({"messages": messages}, qwen3, max_length=limit, truncation="turn")
    assert trained(qwen3, out["labels"]) == (
        "assistantanswer alpha<|im_end|>\nassistantanswer beta<|im_end|>\n"
    )
    removed = len(full["input_ids"]) - len(out["input_ids"])
    assert cut == {"rows": 1, "dropped": 0, "turns": 1, "tokens": removed, "open_turns": 0}
    with caplog.at_level(logging.WARNING, logger="grimoire"):
        ds = tokenize_dataset(
            [{"messages": messages}] * 2,
            tokenize_sft,
            source_name="train",
            tokenizer=qwen3,
            max_length=limit,
            truncation="cut",
        )
    assert ds.column_names == ["input_ids", "attention_mask", "labels"]
    assert "train: cut 2 rows to max_length" in caplog.text
    assert "2 assistant turns cut before their end-of-turn token" in caplog.text


def test_bad_conversations_are_reported_together_with_file_and_line(qwen3, tmp_path):
    u = {"role": "user", "content": "hi"}
    a = {"role": "assistant", "content": "yo"}
    rows = [
        {"messages": [u, a]},
        {"messages": [u, a, u]},  # ends with a user turn
        {"messages": [u, {"role": "assistant", "content": ""}]},  # empty assistant turn
        {"messages": [{"role": "robot", "content": "x"}, a]},  # unknown role
        {"messages": [u, conversations()["tool-call"][0][1]]},  # tool call without tools
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = read_source({"path": str(path)})
    with pytest.raises(DataError) as err:
        tokenize_dataset(
            source.dataset,
            tokenize_sft,
            source_name="dataset",
            locations=source.locations,
            tokenizer=qwen3,
        )
    problems = err.value.problems
    assert len(problems) == 4
    for line, needle in (
        (2, "ends with a 'user' turn"),
        (3, "empty assistant turn"),
        (4, "unknown role 'robot'"),
        (5, "has tool_calls but the row has no 'tools'"),
    ):
        assert any(p.startswith(f"{path}:{line}:") and needle in p for p in problems), needle


def test_think_block_in_content_trains_like_reasoning_content(qwen3):
    messages, _ = conversations()["reasoning"]
    inline = [
        {
            "role": m["role"],
            "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}",
        }
        if "reasoning_content" in m
        else m
        for m in messages
    ]
    # Qwen3's template splits the <think> block out of the content itself: the same rendering.
    assert tokenize_sft({"messages": inline}, qwen3) == tokenize_sft({"messages": messages}, qwen3)


def test_a_template_that_drops_tool_calls_is_reported_with_file_and_line(tmp_path):
    llama3 = char_tokenizer((template_dir() / "llama3.jinja").read_text())
    messages, tools = conversations()["tool-call"]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")
    source = read_source({"path": str(path)})
    with pytest.raises(DataError) as err:
        tokenize_dataset(
            source.dataset,
            tokenize_sft,
            source_name="dataset",
            locations=source.locations,
            tokenizer=llama3,
        )
    [problem] = err.value.problems
    assert problem.startswith(f"{path}:1: message 1 (assistant): its text 'getweather' is not in")


def test_plain_rows_still_get_a_trained_eos_under_a_chat_template(qwen3):
    # Non-conversational rows (TRL appends EOS to them too): the chat template plays no part.
    eos = qwen3.eos_token_id
    sft = tokenize_sft({"prompt": "userquestion one", "response": "answer alpha"}, qwen3)
    assert sft["input_ids"][-1] == sft["labels"][-1] == eos
    assert trained(qwen3, sft["labels"]) == "answer alpha<eos>"
    text = tokenize_sft({"text": "some text"}, qwen3)
    assert text["input_ids"][-1] == text["labels"][-1] == eos
    pref = tokenize_preference({"prompt": "q", "chosen": "good", "rejected": "bad"}, qwen3)
    assert trained(qwen3, pref["chosen_labels"]) == "good<eos>"
    assert trained(qwen3, pref["rejected_labels"]) == "bad<eos>"
    kto = tokenize_kto({"prompt": "q", "completion": "good", "label": False}, qwen3)
    assert trained(qwen3, kto["labels"]) == "good<eos>"


def test_string_responses_already_ending_with_eos_get_no_second_eos(qwen3):
    eos = qwen3.eos_token_id
    sft = tokenize_sft({"prompt": "q", "response": "good<eos>"}, qwen3)
    assert sft["input_ids"][-2:] == [qwen3.convert_tokens_to_ids("d"), eos]
    pref = tokenize_preference({"prompt": "q", "chosen": "good<eos>", "rejected": "bad"}, qwen3)
    assert trained(qwen3, pref["chosen_labels"]) == "good<eos>"
    assert trained(qwen3, pref["rejected_labels"]) == "bad<eos>"


def test_online_prompt_rows_get_no_eos(qwen3):
    # A chat prompt ends with the generation prompt, a string prompt as written: nothing appended.
    prompt = [{"role": "user", "content": "userquestion one"}]
    row = tokenize_grpo({"prompt": prompt, "answer": "x"}, qwen3)
    text = qwen3.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert row["prompt_input_ids"] == qwen3(text, add_special_tokens=False)["input_ids"]
    assert qwen3.eos_token_id not in row["prompt_input_ids"]
    plain = tokenize_grpo({"prompt": "reverse ab="}, qwen3)
    assert plain["prompt_input_ids"] == qwen3("reverse ab=")["input_ids"]


@pytest.mark.parametrize(
    ("name", "closing"),
    [("qwen3", "</tool_call><|im_end|>\n"), ("gptoss", "<|call|>"), ("glm4moe", "</tool_call>")],
)
def test_a_final_tool_call_turn_gets_no_eos_after_its_closing(name, closing):
    # A turn of tool calls ends with the template's tool-call closing (learnt by the probe, the
    # text its labels end with): the row is the rendering, no EOS after it. GLM-4-MoE leaves a
    # final answer open (EOS appended) but closes a tool call with </tool_call>.
    tok = char_tokenizer((template_dir() / f"{name}.jinja").read_text())
    messages, tools = conversations()["tool-call"]
    out = tokenize_sft({"messages": messages[:2], "tools": tools}, tok)
    text = tok.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert out["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert trained(tok, out["labels"]).endswith(closing)
    answer = tokenize_sft({"messages": [messages[0], messages[3]]}, tok)
    assert (answer["input_ids"][-1] == tok.eos_token_id) == (name == "glm4moe")
