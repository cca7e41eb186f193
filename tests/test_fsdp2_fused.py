"""The fused, chunked LM head under FSDP2 (2 gloo processes): the head's weight is gathered
around the chunk loop, the logits never exceed one chunk, and training equals the 1-process run.

The model has vocabulary 80 and hidden size 48, so a float tensor whose innermost dim is 80 is a
logits block (the head weight's transposed view is excluded by its stride); a
TorchDispatchMode around ``trainer.train()`` records the most rows any such tensor had, on every
rank (tests/scripts/fsdp_parity.py, ``VOCAB``). Under the full-logits fallback it would be the
micro-batch's tokens (tens of rows); the fused path keeps it at ``fused_chunk_size`` = 4.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tests.test_fsdp2 import _launch, _one, _result, _same_params

CHUNK, VOCAB = 4, 80
# lora: LoRA adapters with activation checkpointing; osft: OSFT's factored weights.
SHARDED = ["sft", "sft_tied", "dpo", "orpo", "grpo", "lora", "osft"]
ONE = [
    "sft",
    "sft_tied",
    "dpo",
    "grpo",
    "lora",
    "osft",
]  # ORPO's loss depends on the split: against DDP


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    from grimoire.model.tiny import save_tiny

    root = tmp_path_factory.mktemp("fsdp_fused")
    tiny = save_tiny(
        root / "tiny", vocab_size=VOCAB, hidden_size=48, tie_word_embeddings=False, seed=0
    )
    env = {"FUSED_CHUNK": str(CHUNK), "VOCAB": str(VOCAB)}
    _launch(tiny, root / "fsdp2", SHARDED, "fsdp2", 2, 2, env=env)
    _launch(tiny, root / "ddp", ["orpo"], "ddp", 2, 2, env=env)
    _one(tiny, root / "one", ",".join(ONE), env=env)
    return root


@pytest.mark.parametrize("family", SHARDED)
def test_fsdp2_logits_never_exceed_one_chunk(runs, family):
    for rank in (0, 1):
        result = _result(runs / "fsdp2" / family, rank)
        assert result["sharded"]
        assert result["fused_log"] == []  # no "fused log-probs off ..." line
        # GRPO's online method keeps the default chunk (1024 rows): its bound is the batch.
        bound = CHUNK if family != "grpo" else 1024
        assert 0 < result["vocab_peak_rows"] <= bound, result["vocab_peak_rows"]


@pytest.mark.parametrize("family", SHARDED)
def test_fsdp2_fused_equals_the_unsharded_run(runs, family):
    base = runs / ("ddp" if family == "orpo" else "one") / family
    losses = _result(runs / "fsdp2" / family)["losses"]
    assert len(losses) == 3
    assert losses == pytest.approx(_result(base)["losses"], rel=1e-5)
    _same_params(runs / "fsdp2" / family, base)
    if family == "sft_tied":  # one tensor for embedding and head, trained through both
        params = torch.load(runs / "fsdp2" / family / "params.pt", weights_only=True)
        assert "lm_head.weight" not in params or torch.equal(
            params["lm_head.weight"], params["model.embed_tokens.weight"]
        )


def test_a_head_fsdp_cannot_gather_falls_back_naming_why(tiny_dir, caplog):
    """The head as its own fully_shard unit (its hooks would all-gather per chunk): the full
    path runs, logs the reason once, gives the unsharded model's log-probs; ``require`` raises."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from grimoire.errors import ConfigError
    from grimoire.forward.logprobs import compute_token_logps
    from grimoire.parallel.fsdp import ensure_process_group

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, tie_word_embeddings=False)
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    want = compute_token_logps(model, ids, ids).logps
    started = not dist.is_initialized()
    ensure_process_group()
    try:
        fully_shard(model.lm_head)
        fully_shard(model)
        with caplog.at_level(logging.INFO, logger="grimoire.forward.logprobs"):
            got = compute_token_logps(model, ids, ids).logps
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        lines = [r.getMessage() for r in caplog.records if "fused log-probs off" in r.getMessage()]
        assert len(lines) == 1 and "its own fully_shard unit" in lines[0], lines
        with pytest.raises(ConfigError, match="its own fully_shard unit"):
            compute_token_logps(model, ids, ids, fused="require")
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
