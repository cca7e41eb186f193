"""Chat rows under SmolLM2's real ChatML tokenizer: trained exactly as the template renders them
(no EOS after ``<|im_end|>\\n``), assistant turns only; ``pytest -k real_model``."""

from __future__ import annotations

from grimoire.data import tokenize_preference, tokenize_sft

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 10 + 7?"},
    {"role": "assistant", "content": "17, since 10 + 7 = 17."},
]


def _rendered(tokenizer, messages) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    )


def test_real_model_chat_row_is_the_templates_rendering_with_assistant_turns_labelled(
    real_tokenizer,
):
    row = tokenize_sft({"messages": CONVERSATION}, real_tokenizer, max_length=256)
    assert row["input_ids"] == _rendered(real_tokenizer, CONVERSATION)
    text = real_tokenizer.decode(row["input_ids"])
    assert text.endswith("17, since 10 + 7 = 17.<|im_end|>\n")  # once: no EOS after the turn
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    # The answers and each turn's closing marker (with its newline); never system or user text.
    assert real_tokenizer.decode(trained) == "5<|im_end|>\n17, since 10 + 7 = 17.<|im_end|>\n"


def test_real_model_default_system_prompt_and_preference_rows_are_not_trained(real_tokenizer):
    """SmolLM2's template adds its own system turn when the row has none: rendered, not trained."""
    messages = CONVERSATION[1:3]
    row = tokenize_sft({"messages": messages}, real_tokenizer, max_length=256)
    assert row["input_ids"] == _rendered(real_tokenizer, messages)
    assert "named SmolLM" in real_tokenizer.decode(row["input_ids"])
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert real_tokenizer.decode(trained) == "5<|im_end|>\n"
    pair = tokenize_preference(
        {
            "prompt": messages[:1],
            "chosen": [{"role": "assistant", "content": "5"}],
            "rejected": [{"role": "assistant", "content": "6"}],
        },
        real_tokenizer,
        max_length=256,
    )
    for side, answer in (("chosen", "5"), ("rejected", "6")):
        ids, labels = pair[f"{side}_input_ids"], pair[f"{side}_labels"]
        assert ids == _rendered(
            real_tokenizer, [messages[0], {"role": "assistant", "content": answer}]
        )
        trained = [t for t, label in zip(ids, labels) if label != -100]
        assert real_tokenizer.decode(trained) == f"{answer}<|im_end|>\n"
