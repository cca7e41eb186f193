"""Episodes meet the rest of the rollout: sampling turns with a rollout engine, and episodes as
padded tensors for the loss.

:func:`engine_generate` / :func:`engine_generate_batch` turn a bound
:class:`~grimoire.rollout.engine.RolloutEngine` (HF or vLLM) into the ``generate`` callables of
:mod:`grimoire.rollout.episodes`: one completion per prompt, with the sampler's own log-probs
where the backend reports them (vLLM) and the policy's old log-probs otherwise (HF samples from
the training model itself).

:func:`pad_episodes` lays episodes out as the online losses read a rollout: the first prompt
left-padded, everything after it right-padded. Its ``attention_mask`` covers every real token
(the model attends to tool results and environment messages) while ``completion_mask`` is 1
only on the model's own sampled tokens, so the loss trains those alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grimoire.rollout.engine import RolloutEngine, pad_sequences
from grimoire.rollout.episodes import Episode, Generate, GenerateBatch


def engine_generate_batch(engine: RolloutEngine) -> GenerateBatch:
    """``generate_batch(prompts, max_new_tokens)`` sampling one turn per prompt with ``engine``
    (already bound); ``engine.max_new_tokens`` is lowered to the turn's limit for the call."""

    def generate_batch(
        prompts: list[list[int]], max_new_tokens: int
    ) -> list[tuple[list[int], list[float] | None]]:
        limit = engine.max_new_tokens
        engine.max_new_tokens = max(1, min(limit, max_new_tokens))
        try:
            rollout = engine.generate(prompts, 1, with_old_logps=True)
        finally:
            engine.max_new_tokens = limit
        logps = rollout.sampler_logps if rollout.sampler_logps is not None else rollout.old_logps
        out = []
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


__all__ = ["engine_generate", "engine_generate_batch", "pad_episodes"]
