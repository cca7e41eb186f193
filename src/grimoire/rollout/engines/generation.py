"""Text generation helpers shared by evaluation callbacks and online methods."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch

from grimoire.columns import pad_token_id_of
from grimoire.forward.sequence_split import unsplit


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids for a plain prompt, or a chat message list with the generation prompt."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    ids = tokenizer.apply_chat_template(
        list(prompt), tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@contextmanager
def generation_mode(model: torch.nn.Module):
    """Eval mode with the KV cache on for generation, whole rows (no sequence-parallel split:
    a KV cache is not split, so each process generates, or scores, whole rows); restores
    training state afterwards.

    Gradient checkpointing forces ``use_cache=False`` in training; generation wants the cache.
    """
    was_training = model.training
    config = getattr(model, "config", None)
    old_cache = getattr(config, "use_cache", None)
    model.eval()
    if config is not None:
        config.use_cache = True
    try:
        with unsplit():
            yield model
    finally:
        if config is not None:
            config.use_cache = old_cache
        model.train(was_training)


@torch.no_grad()
def greedy_generate_texts(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[Any],
    max_new_tokens: int,
    batch_size: int = 32,
) -> list[str]:
    """Greedy completions (decoded, special tokens skipped) for ``prompts``, left-padded batches."""
    device = next(model.parameters()).device
    generating: Any = model  # a transformers model: generate is not an nn.Module member
    pad = pad_token_id_of(tokenizer, model)
    out: list[str] = []
    with generation_mode(model):
        for start in range(0, len(prompts), batch_size):
            encoded = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
            width = max(len(e) for e in encoded)
            ids = torch.full((len(encoded), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, e in enumerate(encoded):
                ids[i, width - len(e) :] = torch.tensor(e)
                mask[i, width - len(e) :] = 1
            gen = generating.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
            out.extend(tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True))
    return out


class DrawnTokenLogps:
    """A ``generate`` logits processor that records, per decoding step, the log-prob of the
    token drawn at that step: ``log softmax(logits / T)[token]`` over the RAW logits (it runs
    before the temperature/top-k/top-p warpers, which transformers appends after custom
    processors), i.e. what :func:`~grimoire.forward.completions.completion_logps` computes with a
    full forward, without that forward.

    Why it keeps one step's ``[N, V]`` log-probs: the token of step ``t`` is only known at the
    next call (``input_ids[:, -1]``), or after ``generate`` returns (:meth:`finish`). So memory
    stays at one step's logits, never ``[N, C, V]``. Returns the scores unchanged.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self._pending: torch.Tensor | None = None
        self._drawn: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self._drawn.append(self._pending.gather(1, tokens[:, None]).squeeze(1))
            self._pending = None

    def finish(self, generated: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """``[N, new_tokens]`` float32: the drawn tokens' log-probs (``generated``: what
        ``generate`` returned, its last ``new_tokens`` columns the samples)."""
        self._take(generated[:, -1])
        drawn, self._drawn = self._drawn, []
        if not drawn:
            return generated.new_zeros((generated.shape[0], 0), dtype=torch.float32)
        out = torch.stack(drawn, dim=1)
        assert out.shape[1] == new_tokens, (out.shape, new_tokens)
        return out
