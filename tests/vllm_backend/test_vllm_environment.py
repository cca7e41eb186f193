"""Multi-turn episodes sampled by the colocated vLLM engine: several episodes in lockstep, each
sampled token's vLLM log-prob recorded where the policy scores it in the whole episode."""

from __future__ import annotations

import torch
from tests.vllm_backend.common import TINY

from grimoire.model.tiny import build_model, build_tokenizer
from grimoire.rollout.engine import completion_logps
from grimoire.rollout.environment import Step
from grimoire.rollout.episode_batches import engine_generate_batch, pad_episodes
from grimoire.rollout.episodes import EpisodeLimits, run_episodes
from grimoire.rollout.tool_calls import parse_tiny
from grimoire.rollout.vllm_engine import VLLMEngine


class Chatty:
    """Answers every turn with a user message; done after three turns, a reward per turn."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        return Step([{"role": "user", "content": "again"}], 0.5, self.turns == 3)


def test_environment_episodes_with_vllm_record_the_samplers_logps_per_model_token():
    tok = build_tokenizer()
    model = build_model("llama", seed=0, vocab_size=64, **TINY).eval()
    # Any letter ends a turn too: a random model then ends its turns within a few tokens.
    stops = [tok.convert_tokens_to_ids(c) for c in ["<|end|>", *"abcdefghijkl"]]
    engine = VLLMEngine(max_new_tokens=10)
    engine.bind(model, tok.pad_token_id, stops)
    try:
        rows = [{"prompt": "reverse abc="}, {"prompt": "reverse hello="}, {"prompt": "hi"}]
        episodes = run_episodes(
            rows,
            [Chatty() for _ in rows],
            engine_generate_batch(engine),
            tok,
            parse_tiny,
            EpisodeLimits(max_turns=4, max_new_tokens=10, max_tokens=160),
            stop_token_ids=stops,
        )
    finally:
        engine.close()
    assert max(e.turns for e in episodes) >= 2, [(e.stop_reason, e.turns) for e in episodes]
    batch = pad_episodes(episodes, tok.pad_token_id)
    mask = batch["completion_mask"].bool()
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logps, _ = completion_logps(model, batch["input_ids"], batch["attention_mask"], width)
    # fp32 on both sides: vLLM's log-prob of each drawn token (sampled turn by turn) is the
    # policy's log-prob of that token in the whole episode.
    assert (batch["sampler_logps"][mask] - logps[mask]).abs().max() < 1e-4
    assert (batch["sampler_logps"][~mask] == 0).all()
