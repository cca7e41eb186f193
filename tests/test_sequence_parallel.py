"""Sequence parallelism (DeepSpeed-Ulysses) on CPU/gloo: exact against one process.

Two torchrun launches of tests/scripts/sequence_parallel.py. The 2-process one (one sequence
group of 2) scores packed rows of several documents, some crossing the slice boundary, with
the row split over the group, and the same rows one document at a time through the plain sdpa
model with no collective at all (the independent reference: it never sees a packed row); then
3 SGD steps of the SFT token-mean NLL both ways; then ``GrimoireTrainer`` itself, 3 steps of SFT
(with and without activation checkpointing), DPO, KTO, GRPO and RLOO with
``sequence_parallel_size: 2``,
against the same runs in this process (``sequence_parallel_size: 1``); HF greedy sampling with
the Ulysses model; and checkpoints resumed across ``N = 2`` and one process. The 4-process one
repeats the row split and the trainer's SFT, DPO and GRPO for ``N = 4`` (the model's 2
key/value heads repeated), samples greedily from an FSDP2-sharded Ulysses policy, and trains
GRPO (DDP and FSDP2) and SFT (FSDP2) on a 2 data x 2 sequence mesh. The validation tests need
no launch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.train_utils import free_port
from tests.scripts import sequence_parallel as worker
from tests.test_distributed import _env
from transformers import AutoModelForCausalLM

from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.model.tiny import build_model
from grimoire.model.ulysses_attention import repeat_kv_for, unsupported_reason
from grimoire.parallel.sequence import check_sequence_parallel

SCRIPT = Path(worker.__file__)


def _launch(tiny_dir: Path, out: Path, processes: int, *extra: Path) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    cmd += ["--master-port", str(free_port()), str(SCRIPT), str(out), str(tiny_dir), *extra]
    subprocess.run(cmd, check=True, env=_env(), timeout=400)
    return out


@pytest.fixture(scope="module")
def stopped_one_process(tiny_dir, tmp_path_factory) -> Path:
    """One-process SFT stopped at step 2 with a checkpoint (the 2-process launch resumes it)."""
    out = tmp_path_factory.mktemp("one_to_sp2")
    _, trainer = worker.train(str(tiny_dir), out, "sft", 1, stop_after=2)
    trainer.close()
    assert (out / "sft" / "checkpoint-2").is_dir()
    return out


@pytest.fixture(scope="module")
def launched(tiny_dir, tmp_path_factory, stopped_one_process) -> Path:
    """The 2-process launch (one sequence group of 2) most tests below read."""
    out = tmp_path_factory.mktemp("sequence_parallel")
    return _launch(tiny_dir, out, 2, stopped_one_process)


@pytest.fixture(scope="module")
def launched4(tiny_dir, tmp_path_factory) -> Path:
    """The 4-process launch: one sequence group of 4, then a 2 data x 2 sequence mesh."""
    return _launch(tiny_dir, tmp_path_factory.mktemp("sequence_parallel4"), 4)


@pytest.fixture(scope="module", params=[2, 4], ids=["n2", "n4"])
def ranks(request) -> list[dict]:
    """Every rank's numbers of the row split over a group of 2, or of 4."""
    n = request.param
    out = request.getfixturevalue("launched" if n == 2 else "launched4")
    prefix = "" if n == 2 else "n4."
    return [torch.load(out / f"{prefix}rank{r}.pt", weights_only=False) for r in range(n)]


def test_sequence_parallel_each_rank_runs_its_slice(ranks):
    # The rows have 21, 17, 21 tokens: padded to a multiple of N and cut in N (the fused head's
    # forward and the full-logits forward of step 0 each run the model once): N = 2: 22, 18,
    # 22 halved; N = 4: 24, 20, 24 quartered.
    want = [11, 11, 9, 11] if len(ranks) == 2 else [6, 6, 5, 6]
    assert [r["local_lengths"] for r in ranks] == [want] * len(ranks)


def test_ulysses_log_probs_equal_one_process(ranks):
    for r in ranks:
        for step, (sp, ref) in enumerate(zip(r["sp"], r["ref"], strict=True)):
            assert sp.shape == ref.shape  # the whole row on every rank, padding dropped
            torch.testing.assert_close(sp, ref, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        # The full-logits path and its entropies too (step 0, before any update).
        torch.testing.assert_close(r["sp_full"][0], r["ref"][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["sp_entropy"][0], r["ref_entropy"][0], rtol=1e-5, atol=1e-5)
    # The document across the boundary (tokens 5..13 of the first row, slices 0..10 and 11..21)
    # is trained on both sides of it.
    assert bool((ranks[0]["sp"][0][0, 6:13] != 0).all())


def test_sequence_parallel_sft_loss_counts_tokens_once(ranks):
    for r in ranks:
        # 3 + 7 + 2 + 1 targets (each document's tokens after its 2-token prompt), not 2x that.
        assert r["count"] == [13, 13]
        assert r["loss_sp"] == pytest.approx(r["loss_ref"], rel=1e-5)


def test_sequence_parallel_sft_gradients_equal_one_process(ranks):
    for r in ranks:
        for step, (sp, ref) in enumerate(zip(r["grads_sp"], r["grads_ref"], strict=True)):
            assert sp.keys() == ref.keys()
            for name in sp:
                torch.testing.assert_close(
                    sp[name], ref[name], rtol=1e-4, atol=1e-5, msg=f"{name} step {step}"
                )


def test_sequence_parallel_sft_steps_train_the_same_weights(ranks):
    # N = 4 splits the 4 heads 4 ways, each of the 2 key/value heads repeated twice.
    for r in ranks:
        start = build_model("llama", seed=0).state_dict()
        moved = [n for n, p in r["params_ref"][0].items() if not torch.equal(p, start[n])]
        assert moved  # the 3 steps changed the weights, so equality below is not vacuous
        for name, param in r["params_sp"][0].items():
            torch.testing.assert_close(param, r["params_ref"][0][name], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- validation


def test_sequence_parallel_size_is_validated_with_its_key():
    assert TrainingConfig().sequence_parallel_size == 1
    with pytest.raises(ConfigError, match="sequence_parallel_size must be >= 1"):
        TrainingConfig(sequence_parallel_size=0)
    TrainingConfig(sequence_parallel_size=2, distributed="fsdp2")
    with pytest.raises(ConfigError) as err:
        TrainingConfig(sequence_parallel_size=2, fsdp_shard_group_size=2, padding_free=False)
    assert "sequence_parallel_size=2 needs fsdp_shard_group_size null" in str(err.value)
    assert "sequence_parallel_size=2 needs padding_free" in str(err.value)
    with pytest.raises(ConfigError, match="sequence_parallel_size=2 needs torch_compile"):
        TrainingConfig(sequence_parallel_size=2, torch_compile=True)


def test_sequence_parallel_size_must_divide_the_world():
    check_sequence_parallel(2, 4)
    with pytest.raises(ConfigError, match=r"training.sequence_parallel_size=3 does not divide"):
        check_sequence_parallel(3, 4)


def test_ulysses_refuses_heads_not_divisible_and_unsplittable_attention():
    llama = build_model("llama")  # 4 attention heads, 2 key/value heads
    assert unsupported_reason(llama, 2) is None
    assert unsupported_reason(llama, 4) is None  # key/value heads repeated twice
    six = build_model("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=6)
    assert "6 attention heads, which 4 does not divide" in (unsupported_reason(six, 4) or "")
    # How often each key/value head is repeated: the least r with N | H_kv * r.
    assert [repeat_kv_for(kv, n) for kv, n in [(2, 2), (2, 4), (3, 2), (3, 9), (4, 2)]] == [
        1,
        2,
        2,
        3,
        1,
    ]
    gemma = build_model("gemma2")  # softcapping and sliding windows: not plain causal sdpa
    assert "not one grimoire can split" in (unsupported_reason(gemma, 2) or "")


# --------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory) -> dict[str, dict]:
    """The trainer's runs in this process (sequence_parallel_size: 1)."""
    out, runs = tmp_path_factory.mktemp("one_process"), {}
    for family in ("sft", "dpo", "kto", "grpo", "rloo"):
        runs[family], trainer = worker.train(str(tiny_dir), out, family, 1)
        trainer.close()
    return runs


@pytest.mark.parametrize("family", ["sft", "dpo", "kto", "sft_checkpointed", "grpo", "rloo"])
def test_sequence_parallel_trainer_equals_one_process(launched, one_process, tiny_dir, family):
    one = one_process[family.removesuffix("_checkpointed")]  # checkpointing changes no number
    start = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    assert any(not torch.equal(one["params"][k], start[k]) for k in start)  # it trained
    assert one["attention"] == "grimoire_packed_sdpa"
    _assert_equal_to_one_process(launched, one, family, range(2))


@pytest.mark.parametrize("family", ["sft", "dpo", "grpo"])
def test_sequence_parallel_n4_trainer_equals_one_process(launched4, one_process, family):
    # One sequence group of 4 (the model's 4 heads split 4 ways, its 2 key/value heads
    # repeated): the same tokens, losses, weights and (GRPO) per-token reference and old
    # log-probs as one process, on every rank.
    _assert_equal_to_one_process(launched4, one_process[family], f"n4.{family}", range(4))


def _assert_equal_to_one_process(
    out: Path, one: dict, name: str, ranks: range, logps: bool = True
) -> None:
    """Every rank's run ``name`` against the one-process one: the policy's attention was the
    Ulysses one (the split really ran); tokens counted once per sequence group (not N times),
    the same losses and weights; with ``logps``, the groups' reference and (GRPO) old log-probs,
    split forwards at temperature 0.7, are the one-process ones, per token."""
    for rank in ranks:
        split = torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)
        assert split["attention"] == "grimoire_ulysses"
        assert split["tokens"] == one["tokens"]
        assert split["losses"] == pytest.approx(one["losses"], rel=1e-5)
        if split["mesh"] is None or rank == 0:  # FSDP2's gathered weights are on rank 0
            for key, param in one["params"].items():
                torch.testing.assert_close(split["params"][key], param, rtol=1e-4, atol=1e-6)
        for key in ("ref_logps", "old_logps") if logps else ():
            assert len(split.get(key, [])) == len(one.get(key, []))
            for got, want in zip(split.get(key, []), one.get(key, []), strict=True):
                assert bool((want != 0).any())
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["grpo", "sft_fsdp2", "grpo_fsdp2"])
def test_sequence_parallel_on_a_2x2_mesh_equals_one_process(launched4, one_process, family):
    # 4 processes = 2 data x 2 sequence ranks, each data rank reading half the global batch:
    # the same tokens (each sequence group counted once), losses and weights as one process;
    # GRPO's batch-scaled rewards take their std over the 2 data ranks' groups. *_fsdp2:
    # FSDP2 (HSDP) replicates over each sequence group ({0, 1}, {2, 3}) and shards over the
    # data ranks ({0, 2}, {1, 3}); GRPO's every rank samples (a sharded forward is a
    # collective), and the groups use their rank 0's samples.
    one = one_process[family.removesuffix("_fsdp2")]
    mesh = [[0, 2], [1, 3]] if family.endswith("_fsdp2") else None
    for rank in range(4):
        split = torch.load(launched4 / f"mesh2x2.{family}.rank{rank}.pt", weights_only=False)
        assert split["mesh"] == mesh
    # (Each data rank scored its own half of the groups: no per-token comparison.)
    _assert_equal_to_one_process(launched4, one, f"mesh2x2.{family}", range(4), logps=False)


def test_sequence_parallel_fsdp2_policy_samples_as_the_plain_model(launched4):
    # Greedy sampling from the Ulysses model sharded by FSDP2 over the data ranks: every rank
    # samples in step (the second data rank makes 3 sampling calls, the first 2 and a filler),
    # and each group's tokens are its rank 0's, the plain model's.
    got = [torch.load(launched4 / f"greedy.fsdp2.rank{r}.pt", weights_only=False) for r in range(4)]
    for rank, greedy in enumerate(got):
        assert greedy["split"] == greedy["plain"]
        assert len(greedy["split"]) == (3 if rank < 2 else 5)
        assert all(len(row) >= 1 for row in greedy["split"])


def test_sequence_parallel_resume_on_another_size_equals_the_uninterrupted_run(
    launched, one_process, tiny_dir
):
    want = one_process["sft"]["params"]
    # sequence_parallel_size 2 stopped at step 2; one process resumes to step 3.
    assert (launched / "sp2_to_1" / "sft" / "checkpoint-2").is_dir()
    resumed, trainer = worker.train(str(tiny_dir), launched / "sp2_to_1", "sft", 1, resume=True)
    trainer.close()
    # One process stopped at step 2; sequence_parallel_size 2 resumed to step 3.
    runs = [resumed] + [
        torch.load(launched / f"one_to_sp2.rank{r}.pt", weights_only=False) for r in range(2)
    ]
    for run in runs:
        assert run["steps_run"] == [3]  # resumed after the checkpoint, not trained again
        for name, param in want.items():
            torch.testing.assert_close(run["params"][name], param, rtol=1e-4, atol=1e-6)
    assert runs[2]["attention"] == "grimoire_ulysses"


def test_sequence_parallel_grpo_samples_once_per_group(launched, one_process):
    # 2 steps per rollout over 3 steps: 2 rollouts of 2 prompt groups (2 micro-batches each).
    assert len(one_process["grpo"]["old_logps"]) == 4
    # The engine's completions depend on the rank that samples: rank 1 scored rank 0's (had it
    # sampled its own, its log-probs above would be of other tokens, and its shapes differ).
    ranks = [torch.load(launched / f"grpo.rank{r}.pt", weights_only=False) for r in range(2)]
    for a, b in zip(ranks[0]["old_logps"], ranks[1]["old_logps"], strict=True):
        assert torch.equal(a, b)


def test_ulysses_model_samples_unsplit_with_its_kv_cache(launched):
    for rank in range(2):
        greedy = torch.load(launched / f"greedy.rank{rank}.pt", weights_only=False)
        assert greedy["split"] == greedy["plain"]
        assert greedy["split_texts"] == greedy["plain_texts"]  # the callbacks' generation
        assert len(greedy["split_texts"]) == 2 and all(greedy["split_texts"])
        assert len(greedy["split"]) == 3 and all(len(row) >= 1 for row in greedy["split"])


def test_sequence_parallel_refuses_generating_methods_and_padded_rows():
    from grimoire.losses import SFTLoss
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.losses.online_dpo import OnlineDPOMethod
    from grimoire.losses.rloo import RLOOMethod
    from grimoire.parallel.sequence import check_method

    check_method(2, SFTLoss(), packed=True)
    check_method(1, SFTLoss(), packed=False)  # off: nothing refused
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=2 splits packed rows"):
        check_method(2, SFTLoss(), packed=False)
    check_method(2, GRPOMethod(["exact_match"]), packed=True)  # synchronous HF rollouts
    check_method(2, RLOOMethod(["exact_match"]), packed=True)
    with pytest.raises(ConfigError, match=r"=2: OnlineDPOMethod runs forwards of its own"):
        check_method(2, OnlineDPOMethod(["exact_match"]), packed=True)
    with pytest.raises(ConfigError) as err:
        check_method(2, GRPOMethod(["exact_match"], max_staleness=1), packed=True)
    assert "loss.args.max_staleness=1" in str(err.value)
