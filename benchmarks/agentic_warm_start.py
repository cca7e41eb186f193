"""How well an SFT warm start plays the tiny lookup task, measured through multi-turn episodes.

The tiny Llama is trained with SFT on ``lookup_chat_rows`` (the user asks ``reverse abc=``, the
assistant calls ``lookup(word=abc)``, the tool answers, the assistant copies the answer), then
plays 64 held-out episodes with the HF engine (sampling at temperature 1, ``ToolEnvironment``
with the ``lookup`` tool, the ``tiny`` parser). Printed per number of SFT steps: the share of
episodes whose first call is ``lookup`` on the right word, the exact-match rate of the final
answer, and the parse errors. It sizes the warm start of a tool-using RL example: one that
already solves the task leaves RL nothing to learn.

    PYTHONPATH=src python benchmarks/agentic_warm_start.py 400 1000
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from grimoire import GrimoireTrainer, TrainingConfig
from grimoire.losses import SFTLoss
from grimoire.model.tiny import build_model, build_tokenizer, lookup, lookup_chat_rows, reverse_rows
from grimoire.rollout.agents.environment import ToolEnvironment
from grimoire.rollout.agents.episode_batches import engine_generate_batch, score_episodes
from grimoire.rollout.agents.episodes import EpisodeLimits, run_episodes, sum_metrics
from grimoire.rollout.agents.tool_parsers import parse_tiny
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.rewards.scoring import resolve_reward_funcs
from grimoire.rows.sft import tokenize_sft


def warm_start(steps: int, tok, output_dir: str, direct_share: float = 0.0):
    rows = lookup_chat_rows(steps * 16, seed=0, direct_share=direct_share)
    rows = [tokenize_sft(r, tok, 128) for r in rows]
    model = build_model(vocab_size=64, seed=0)
    config = TrainingConfig(
        output_dir=output_dir,
        batch_size=16,
        learning_rate=1.5e-3,
        lr_scheduler="cosine",
        warmup_steps=10,
        weight_decay=0.0,
        max_steps=steps,
        max_length=128,
        mixed_precision="no",
        gradient_checkpointing=False,
        progress_bar=False,
        save_on_epoch_end=False,
        logging_steps=max(steps, 1),
        seed=0,
    )
    GrimoireTrainer(
        model=model, tokenizer=tok, loss_fn=SFTLoss(), train_dataset=rows, config=config
    ).train()
    return model.eval()


def play(model, tok) -> dict[str, float]:
    end = tok.convert_tokens_to_ids("<|end|>")
    engine = HFGenerateEngine(max_new_tokens=32)
    engine.bind(model, tok.pad_token_id, [end, tok.eos_token_id])
    held = reverse_rows(64, seed=1)
    torch.manual_seed(0)
    episodes = run_episodes(
        held,
        [ToolEnvironment([lookup]) for _ in held],
        engine_generate_batch(engine),
        tok,
        parse_tiny,
        EpisodeLimits(max_turns=3, max_new_tokens=32, max_tokens=256),
        stop_token_ids=[end, tok.eos_token_id],
    )
    _, per_func = score_episodes(resolve_reward_funcs(["exact_match"]), episodes, held, tok)
    right = [
        bool(e.tool_calls and e.tool_calls[0][:1])
        and e.tool_calls[0][0].name == "lookup"
        and e.tool_calls[0][0].arguments == {"word": r["prompt"][len("reverse ") : -1]}
        for e, r in zip(episodes, held)
    ]
    metrics = sum_metrics(episodes)
    return {
        "right call": sum(right) / len(right),
        "exact match": per_func["exact_match_reward"].mean().item(),
        "parse errors": metrics.get("tool_calls/parse_errors", 0.0),
    }


def main(steps_list: list[int]) -> None:
    torch.set_num_threads(1)
    tok = build_tokenizer()
    print("| SFT steps | train s | right call | exact match | parse errors |")
    print("|---|---|---|---|---|")
    for steps in steps_list:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            model = warm_start(steps, tok, out)
        seconds = time.perf_counter() - start
        r = play(model, tok)
        print(
            f"| {steps} | {seconds:.0f} | {r['right call']:.3f} | {r['exact match']:.3f} | "
            f"{r['parse errors']:.0f} |"
        )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [400, 1000])
