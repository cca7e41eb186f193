"""Episodes meet the rest of the rollout: sampling turns with a rollout engine, and episodes as
padded tensors for the loss.

:func:`engine_generate` / :func:`engine_generate_batch` turn a bound
:class:`~grimoire.rollout.engines.base.RolloutEngine` (HF or vLLM) into the ``generate`` callables of
:mod:`grimoire.rollout.agents.episodes`: one completion per prompt, with the sampler's own log-probs
where the backend reports them (vLLM) and the policy's old log-probs otherwise (HF samples from
the training model itself).

:func:`pad_episodes` lays episodes out as the online losses read a rollout: the first prompt
left-padded, everything after it right-padded. Its ``attention_mask`` covers every real token
(the model attends to tool results and environment messages) while ``completion_mask`` is 1
only on the model's own sampled tokens, so the loss trains those alone.

:func:`score_episodes` gives the reward functions of :mod:`grimoire.rollout.rewards.scoring` the whole
episode: ``completions`` are the final assistant answers, and besides the dataset's columns they
receive ``messages``, ``tool_calls``, ``env_reward``, ``stop_reason`` and ``episode_failed``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grimoire.collate.common import pad_sequences
from grimoire.rollout.agents.environment import Environment
from grimoire.rollout.agents.episodes import (
    Episode,
    EpisodeLimits,
    Generate,
    GenerateBatch,
    run_episodes,
)
from grimoire.rollout.agents.tool_parsers import ToolCallParser
from grimoire.rollout.engines.base import RolloutEngine
from grimoire.rollout.rewards.scoring import RewardFunction, score_completions


def engine_generate_batch(engine: RolloutEngine, greedy: bool = False) -> GenerateBatch:
    """``generate_batch(prompts, max_new_tokens)`` sampling one turn per prompt with ``engine``
    (already bound), at most the turn's ``max_new_tokens`` (:meth:`RolloutEngine.turn_limit`);
    ``greedy``: the most likely tokens (evaluation)."""

    def generate_batch(
        prompts: list[list[int]], max_new_tokens: int
    ) -> list[tuple[Sequence[int], Sequence[float] | None]]:
        with engine.turn_limit(max_new_tokens):
            rollout = engine.generate(prompts, 1, with_old_logps=not greedy, greedy=greedy)
        logps = rollout.sampler_logps if rollout.sampler_logps is not None else rollout.old_logps
        out: list[tuple[Sequence[int], Sequence[float] | None]] = []
        for i in range(len(prompts)):
            keep = rollout.completion_mask[i].bool()
            ids = rollout.completion_ids[i][keep].tolist()
            out.append((ids, logps[i][keep].tolist() if logps is not None else None))
        return out

    return generate_batch


def engine_generate(engine: RolloutEngine) -> Generate:
    """The one-prompt form of :func:`engine_generate_batch`."""
    batch = engine_generate_batch(engine)

    def generate(prompt_ids: list[int], max_new_tokens: int):
        return batch([prompt_ids], max_new_tokens)[0]

    return generate


def pad_episodes(episodes: Sequence[Episode], pad_token_id: int) -> dict[str, Tensor | None]:
    """Episodes as tensors (``N`` episodes, ``P`` the longest first prompt, ``C`` the longest
    rest):

    - ``prompt_ids [N, P]`` left-padded, ``completion_ids [N, C]`` right-padded;
    - ``attention_mask [N, P + C]``: 1 on every real token;
    - ``completion_mask [N, C]``: 1 on the model's sampled tokens only (the loss mask);
    - ``sampler_logps [N, C]`` float32, 0 off the model's tokens (``None`` if any episode has
      none); ``rewards [N]`` float32.
    """
    if not episodes:
        raise ValueError("pad_episodes needs at least one episode")
    prompts = [e.input_ids[: e.prompt_length] for e in episodes]
    rests = [e.input_ids[e.prompt_length :] for e in episodes]
    prompt_ids, prompt_mask = pad_sequences(prompts, pad_token_id, left=True, min_width=1)
    completion_ids, completion_attention = pad_sequences(
        rests, pad_token_id, left=False, min_width=1
    )
    width = completion_ids.shape[1]
    loss_mask = torch.zeros((len(episodes), width), dtype=torch.long)
    with_logps = all(e.sampler_logps is not None for e in episodes)
    logps = torch.zeros((len(episodes), width), dtype=torch.float32) if with_logps else None
    for i, e in enumerate(episodes):
        rest = len(rests[i])
        loss_mask[i, :rest] = torch.tensor(e.completion_mask[e.prompt_length :], dtype=torch.long)
        if logps is not None:
            logps[i, :rest] = torch.tensor(e.sampler_logps[e.prompt_length :], dtype=torch.float32)  # type: ignore[index]
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, completion_attention], dim=1),
        "completion_mask": loss_mask,
        "sampler_logps": logps,
        "rewards": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
    }


def play_groups(
    rows: Sequence[Mapping[str, Any]],
    env_factory: Callable[[], Environment],
    generate_batch: GenerateBatch,
    tokenizer,
    parser: ToolCallParser,
    group_size: int,
    limits: EpisodeLimits | None = None,
    stop_token_ids: Sequence[int] | None = None,
) -> list[Episode]:
    """``group_size`` episodes per row, prompt-major as a rollout's rows (``i * G .. i * G + G -
    1`` are row ``i``'s), each with its own environment from ``env_factory()``, all played in
    lockstep; named ``"<row>/<sample>"`` in the log. What a rollout stage calls for one step."""
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    repeated = [row for row in rows for _ in range(group_size)]
    names = [f"{i}/{g}" for i in range(len(rows)) for g in range(group_size)]
    envs = [env_factory() for _ in repeated]
    return run_episodes(
        repeated,
        envs,
        generate_batch,
        tokenizer,
        parser,
        limits or EpisodeLimits(),
        stop_token_ids,
        names,
    )


#: The columns an episode adds to its row's for reward functions (see :func:`episode_reward_inputs`).
EPISODE_COLUMNS = ("messages", "tool_calls", "env_reward", "stop_reason", "episode_failed")


def final_answer(episode: Episode) -> str:
    """The content of the episode's last assistant message ("" when it has none)."""
    for message in reversed(episode.messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def episode_reward_inputs(
    episodes: Sequence[Episode], rows: Sequence[Mapping[str, Any]], tokenizer
) -> tuple[list[str], list[str], dict[str, list[Any]]]:
    """``(prompts, completions, columns)`` for reward functions, one entry per episode:
    the first prompt as the model saw it, the final answer, and the row's fields with the
    environment's ``reward_columns()`` and the episode's ``messages``, ``tool_calls`` (per turn, as message entries), ``env_reward``,
    ``stop_reason`` and ``episode_failed``."""
    if len(rows) != len(episodes):
        raise ValueError(f"{len(rows)} rows for {len(episodes)} episodes")
    prompts = [tokenizer.decode(e.input_ids[: e.prompt_length]) for e in episodes]
    completions = [final_answer(e) for e in episodes]
    columns: dict[str, list[Any]] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        columns[key] = [row.get(key) for row in rows]
    for key in dict.fromkeys(k for e in episodes for k in e.columns):  # the environment's
        columns[key] = [e.columns.get(key) for e in episodes]
    columns["messages"] = [e.messages for e in episodes]
    columns["tool_calls"] = [
        [[c.as_message_call() for c in t] for t in e.tool_calls] for e in episodes
    ]
    columns["env_reward"] = [e.reward for e in episodes]
    columns["stop_reason"] = [e.stop_reason for e in episodes]
    columns["episode_failed"] = [e.failure is not None for e in episodes]
    return prompts, completions, columns


def score_episodes(
    reward_funcs: Sequence[RewardFunction],
    episodes: Sequence[Episode],
    rows: Sequence[Mapping[str, Any]],
    tokenizer,
    metrics: dict[str, float] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Each episode's reward: its environment's rewards plus ``sum_k w_k * r_k`` of the reward
    functions; an episode whose environment failed keeps its ``failure_reward`` alone.
    ``metrics``: the reward functions' call counts (:func:`score_completions`).

    Shapes: ``N`` episodes -> ``total [N]`` float32 and ``{name: r_k [N]}``.
    """
    return episode_scoring(reward_funcs, episodes, rows, tokenizer)(metrics)


def episode_scoring(
    reward_funcs: Sequence[RewardFunction],
    episodes: Sequence[Episode],
    rows: Sequence[Mapping[str, Any]],
    tokenizer,
) -> Callable[[dict[str, float] | None], tuple[Tensor, dict[str, Tensor]]]:
    """:func:`score_episodes` in two halves: the texts are decoded now, by the calling thread
    (which owns the tokenizer); the returned call runs the reward functions, on any thread."""
    prompts, completions, columns = episode_reward_inputs(episodes, rows, tokenizer)
    # An episode's completion is everything after its prompt (tool results included).
    ids = [list(e.input_ids[e.prompt_length :]) for e in episodes]
    env = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    failed = torch.tensor([e.failure is not None for e in episodes])

    def score(metrics: dict[str, float] | None) -> tuple[Tensor, dict[str, Tensor]]:
        total, per_func = score_completions(
            reward_funcs, prompts, completions, columns, completion_ids=ids, metrics=metrics
        )
        return torch.where(failed, env, env + total), per_func

    return score


__all__ = [
    "EPISODE_COLUMNS",
    "engine_generate",
    "engine_generate_batch",
    "episode_reward_inputs",
    "episode_scoring",
    "final_answer",
    "pad_episodes",
    "play_groups",
    "score_episodes",
]
