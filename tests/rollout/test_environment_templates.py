"""Multi-turn episodes under real chat templates (TRL's stock ones) and with the real HF rollout
engine: the episode appends token ids, so its model tokens are exactly the sampled ones even
where re-tokenizing the rendered conversation would give other ids."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from tests.helpers.chat_templates import bpe_tokenizer, template_dir
from tests.helpers.chat_templates import char_tokenizer as _char_tokenizer
from tests.helpers.episodes import Chatty
from tokenizers import decoders

from grimoire.forward.completions import completion_logps
from grimoire.model.tiny import build_model
from grimoire.rollout.agents.environment import ToolEnvironment
from grimoire.rollout.agents.episode_batches import engine_generate, pad_episodes
from grimoire.rollout.agents.episodes import EpisodeLimits, run_episode
from grimoire.rollout.agents.tool_parsers import ToolCall, resolve_tool_call_parser
from grimoire.rollout.engines.hf import HFGenerateEngine

# template -> (parser, the token closing an assistant turn)
TEMPLATES = {
    "qwen2_5": ("hermes", "<|im_end|>"),
    "qwen3": ("hermes", "<|im_end|>"),
    "qwen3_instruct_2507": ("hermes", "<|im_end|>"),
    "llama3_1": ("llama3_json", "<|eot_id|>"),
    "llama3_2": ("llama3_json", "<|eot_id|>"),
    "qwen3_6": ("qwen3_coder", "<|im_end|>"),
}


def char_tokenizer(template: str):
    """The character-level test tokenizer, decoding ids back to the text they encode."""
    tok = _char_tokenizer(template)
    tok.backend_tokenizer.decoder = decoders.Fuse()
    return tok


def getweather(city: str) -> str:
    """Weather of a city.

    Args:
        city: the city
    """
    return f"sunny in {city}"


CALL = ToolCall("getweather", {"city": "zurichcity"})


def template_turn(tok, call: ToolCall | None, content: str = "") -> str:
    """What the template writes for an assistant turn (up to its closing token), i.e. what a
    model trained on it samples."""
    user = [{"role": "user", "content": "userquestion"}]
    turn = {"role": "assistant", "content": content}
    if call is not None:
        turn["tool_calls"] = [call.as_message_call()]
    schema = ToolEnvironment([getweather]).tools
    prompt = tok.apply_chat_template(user, tools=schema, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(user + [turn], tools=schema, tokenize=False)
    return full[len(prompt) :]


class Texts:
    """A ``generate`` that samples given texts, one token id per character (so the ids differ
    from the tokenizer's own encoding of the text whenever it would merge characters)."""

    def __init__(self, tok, closing: str, *texts: str, per_char: bool = False):
        self.tok, self.samples, self.prompts = tok, [], []
        end = tok.convert_tokens_to_ids(closing)
        self.turns = []
        for text in texts:
            body = text[: text.index(closing)]
            if per_char:
                sample = [i for ch in body for i in tok(ch, add_special_tokens=False)["input_ids"]]
            else:
                sample = tok(body, add_special_tokens=False)["input_ids"]
            self.turns.append(sample + [end])

    def __call__(self, prompt_ids, max_new_tokens):
        sample = self.turns[len(self.prompts)]
        self.prompts.append(list(prompt_ids))
        self.samples.append(sample)
        return sample, [-1.0] * len(sample)


def play(tok, name: str, gen: Texts):
    parser, closing = TEMPLATES[name]
    return run_episode(
        {"prompt": "userquestion"},
        ToolEnvironment([getweather]),
        gen,
        tok,
        resolve_tool_call_parser(parser),
        EpisodeLimits(max_tokens=8192),
        stop_token_ids=[tok.convert_tokens_to_ids(closing)],
    )


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_environment_episode_under_stock_templates_renders_the_conversation(name):
    tok = char_tokenizer((template_dir() / f"{name}.jinja").read_text())
    closing = TEMPLATES[name][1]
    gen = Texts(tok, closing, template_turn(tok, CALL), template_turn(tok, None, "finalanswer"))
    ep = play(tok, name, gen)
    assert ep.stop_reason == "done", ep.metrics
    assert [[c for c in turn] for turn in ep.tool_calls] == [[CALL], []]
    assert ep.messages[2]["content"] == "sunny in zurichcity"
    assert ep.model_token_ids == gen.samples[0] + gen.samples[1]
    # The tokens between the samples are the template's: the episode reads as the template's
    # rendering of the whole conversation (up to what follows the last turn's closing token).
    text = tok.decode(ep.input_ids, skip_special_tokens=False)
    if name == "qwen3":
        # Qwen3 writes the empty think block only in the last assistant turn: re-rendered, the
        # first turn loses the block the model sampled (the episode keeps what was sampled).
        assert text.count("<think>\n\n</think>\n\n") == 2
        text = text.replace("<think>\n\n</think>\n\n", "", 1)
    rendered = tok.apply_chat_template(
        ep.messages, tools=ToolEnvironment([getweather]).tools, tokenize=False
    )
    assert rendered.startswith(text) and rendered[len(text) :].strip() == ""
    assert "episode/stop_token_not_rendered" not in ep.metrics


@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1"])
def test_environment_episode_keeps_sampled_ids_where_retokenizing_differs(name):
    # A BPE tokenizer merges characters; the sampler emitted the same text one character per
    # token, and with other JSON spacing than the template writes.
    tok = bpe_tokenizer((template_dir() / f"{name}.jinja").read_text())
    closing = TEMPLATES[name][1]
    turn = template_turn(tok, CALL).replace('", "', '","').replace('": ', '":')
    gen = Texts(tok, closing, turn, template_turn(tok, None, "finalanswer"), per_char=True)
    ep = play(tok, name, gen)
    assert ep.tool_calls == [[CALL], []]
    assert ep.model_token_ids == gen.samples[0] + gen.samples[1]
    text = tok.decode(ep.input_ids, skip_special_tokens=False)
    assert tok(text, add_special_tokens=False)["input_ids"] != ep.input_ids  # re-tokenizing differs
    for k in range(1):  # and each prompt extended the last prompt plus its sample
        before = gen.prompts[k] + gen.samples[k]
        assert gen.prompts[k + 1][: len(before)] == before


def test_environment_episode_ends_where_the_template_refuses_the_conversation(caplog):
    # Llama 3.1's template raises on a turn with two calls; the model wrote two: the calls run,
    # then the episode ends there (counted, logged), instead of the run.
    tok = char_tokenizer((template_dir() / "llama3_1.jinja").read_text())
    one = template_turn(tok, CALL)
    two = one.replace(
        "}}<|eot_id|>", '}}; {"name": "getweather", "parameters": {"city": "b"}}<|eot_id|>'
    )
    ep = play(tok, "llama3_1", Texts(tok, "<|eot_id|>", two))
    assert ep.stop_reason == "template_error"
    assert ep.tool_calls == [[CALL, ToolCall("getweather", {"city": "b"})]]
    assert ep.metrics["episode/template_errors"] == 1 and ep.metrics["tools/ok"] == 2
    assert "episode 0: the chat template refuses the conversation after turn 1" in caplog.text


def test_environment_failure_when_the_template_refuses_the_first_messages():
    tok = char_tokenizer((template_dir() / "llama3_1.jinja").read_text())
    calls = [CALL.as_message_call()] * 2
    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": calls}]
    }
    parser, closing = TEMPLATES["llama3_1"]
    ep = run_episode(
        row,
        ToolEnvironment([getweather]),
        Texts(tok, closing),
        tok,
        resolve_tool_call_parser(parser),
        EpisodeLimits(failure_reward=-1.0),
    )
    assert ep.stop_reason == "environment_error" and ep.reward == -1.0
    assert ep.failure.startswith("reset bad_return: the chat template refuses its messages: ")
    assert "only supports single tool-calls" in ep.failure


@pytest.mark.usefixtures("one_thread")
def test_environment_episode_with_the_hf_engine_records_the_policys_logps_per_token():
    tok = char_tokenizer(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    model = build_model(vocab_size=len(tok) + 8, seed=3).eval()
    # Any letter ends a turn: a random model then ends its turns within a few tokens.
    stops = [tok.convert_tokens_to_ids(c) for c in "abcdefghijkl"]
    engine = HFGenerateEngine(max_new_tokens=12, temperature=1.0)
    engine.bind(model, tok.pad_token_id, stops)
    torch.manual_seed(0)
    ep = run_episode(
        {"prompt": "hello"},
        Chatty(),
        engine_generate(engine),
        tok,
        resolve_tool_call_parser("hermes"),
        EpisodeLimits(max_turns=5, max_new_tokens=12, max_tokens=200),
        stop_token_ids=stops,
    )
    assert ep.turns >= 2, (ep.stop_reason, ep.turns)  # several turns sampled by the engine
    batch = pad_episodes([ep], tok.pad_token_id)
    mask = batch["completion_mask"].bool()
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logps, _ = completion_logps(model, batch["input_ids"], batch["attention_mask"], width)
    # Each sampled token's log-prob from the engine (scored per turn) = the policy's log-prob of
    # that token in the whole episode: the bookkeeping the importance-sampling correction needs.
    torch.testing.assert_close(batch["sampler_logps"][mask], logps[mask], atol=1e-5, rtol=1e-5)
    assert (batch["sampler_logps"][~mask] == 0).all()
    assert ep.env_rewards == [0.5] * len(ep.env_rewards)
