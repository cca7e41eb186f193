"""Ulysses sequence parallelism against one process (run under torchrun, 2 or 4 processes).

Usage: ``torchrun --nproc-per-node N sequence_parallel.py OUT_DIR TINY_DIR [ONE_RUN]``
(``ONE_RUN``, with N = 2: a one-process SFT run's folder holding its step-2 checkpoint).

:func:`split_rows`: every rank scores the same packed rows of several documents, some crossing
slice boundaries, with each row split over a sequence group of N
(``grimoire.forward.logprobs.compute_token_logps`` on a model with ``grimoire_ulysses``
attention), and independently without any collective: each document alone through the plain
sdpa model, log-softmax of its full logits; then ``STEPS`` SGD steps of the SFT token-mean NLL
both ways. Writes ``OUT_DIR/[n4.]rank<r>.pt`` with both sides' numbers.

Then the trainer itself (:func:`train`, 3 steps, ``sequence_parallel_size: 2``), writing
``OUT_DIR/<family>.rank<r>.pt`` (the trained weights, the losses, the attention
implementation); the test runs the same :func:`train` in one process. N = 2: SFT (with and
without activation checkpointing), DPO, GRPO and RLOO, HF greedy sampling with the Ulysses model
(:func:`greedy_samples`), and checkpoints resumed on another N (:func:`resume_across_sizes`).
N = 4: SFT and GRPO on a 2 data x 2 sequence mesh, and SFT with FSDP2 sharding over the data
ranks (``OUT_DIR/mesh2x2.<family>.rank<r>.pt``).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
from grimoire.columns import IGNORE_INDEX
from grimoire.data import tokenize_grpo, tokenize_kto, tokenize_preference, tokenize_sft
from grimoire.forward.attention_hints import attention_impl
from grimoire.forward.logprobs import compute_token_logps
from grimoire.forward.sequence_split import set_sequence_group
from grimoire.losses import DPOLoss, KTOLoss, SFTLoss
from grimoire.model.tiny import build_model, kto_rows, preference_rows, reverse_rows
from grimoire.model.ulysses_attention import enable_ulysses_attention
from grimoire.parallel.fsdp import full_state_dict, is_sharded
from grimoire.parallel.sequence import sequence_mesh, sum_sequence_grads
from grimoire.rollout.engines.base import RolloutEngine
from grimoire.rollout.engines.hf import HFGenerateEngine

#: Document lengths of the packed rows: 21 and 17 tokens, odd (the split pads them), with a
#: document across the middle (tokens 5..13 of the first row).
ROWS = ([5, 9, 4, 3], [3, 11, 3])
STEPS = 3
LR = 0.5


def packed_row(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids, labels, position_ids`` ``[1, L]``; each document's first 2 tokens (its
    prompt) have no label."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 64, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(positions < 2, IGNORE_INDEX)
    return ids, labels, positions


def reference_logps(
    model: torch.nn.Module, ids, labels, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, L]`` log-probs and entropies: at position ``t``, ``log p(ids[t+1])`` from the
    document alone, where ``t+1`` is in the same document and labelled; 0 elsewhere."""
    out = torch.zeros(ids.shape, dtype=torch.float32)
    entropy = torch.zeros(ids.shape, dtype=torch.float32)
    start = 0
    for n in lengths:
        doc = ids[:, start : start + n]
        logps = F.log_softmax(model(input_ids=doc).logits.float(), dim=-1)
        picked = logps[0, :-1].gather(-1, doc[0, 1:, None])[:, 0]
        keep = labels[0, start + 1 : start + n] != IGNORE_INDEX
        out[0, start : start + n - 1] = picked * keep
        ent = -(logps[0, :-1].exp() * logps[0, :-1]).sum(-1)
        entropy[0, start : start + n - 1] = (ent * keep).detach()
        start += n
    return out, entropy


class RankedEngine(RolloutEngine):
    """Completion ``j`` of a prompt: a fixed function of the prompt, ``j`` and this process's
    place in its sequence group of ``group`` ranks, 6 to 13 tokens. The one-process run is
    place 0; under sequence parallelism only place 0's samples may be used by the group (a rank
    that used its own would score other tokens)."""

    group = 1

    def _sample(self, prompts: list[list[int]], n: int, greedy: bool) -> list[list[int]]:
        rank = dist.get_rank() % self.group if dist.is_initialized() else 0
        out = []
        for p in prompts:
            for j in range(n):
                seed = sum(p) * 31 + j * 17 + rank * 5
                out.append([8 + (seed + 7 * k) % 56 for k in range(6 + (seed + j) % 8)])
        return out


def grpo_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [len(c) + (sum(map(ord, c)) % 13) / 13 for c in completions]


def online_method(family: str, group: int) -> tuple[object, dict[str, list]]:
    """GRPO or RLOO with a reference (split reference forward), temperature 0.7 (the
    full-logits path) and step statistics over the data ranks (GRPO's batch-scaled rewards,
    RLOO's normalised advantages); GRPO updates twice per rollout (split old log-probs). The
    groups' reference and old log-probs are recorded."""
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.losses.rloo import RLOOMethod

    common = dict(num_generations=4, max_new_tokens=13, temperature=0.7, ref_model="copy")
    engine = RankedEngine(max_new_tokens=13, temperature=0.7)
    engine.group = group
    if family == "grpo":
        method = GRPOMethod(
            [grpo_reward],
            engine=engine,
            beta=0.05,
            num_iterations=2,
            scale_rewards="batch",
            **common,
        )
    else:
        method = RLOOMethod([grpo_reward], engine=engine, normalize_advantages=True, **common)
    seen: dict[str, list] = {"ref_logps": [], "old_logps": []}
    build = method.build_batches

    def recording(ctx, groups):
        for g in groups:
            seen["ref_logps"].append(g.ref_logps.detach().clone())
            if g.rollout.old_logps is not None:
                seen["old_logps"].append(g.rollout.old_logps.detach().clone())
        return build(ctx, groups)

    method.build_batches = recording  # type: ignore[method-assign]
    return method, seen


def nll(logps: torch.Tensor, count: int) -> torch.Tensor:
    return -logps.sum() / count


class StepsRun(TrainerCallback):
    """The optimizer steps this ``train()`` call ran (a resumed run starts after its checkpoint)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        self.steps.append(step)


def train(
    tiny_dir: str,
    out_dir: Path,
    family: str,
    sequence_parallel_size: int,
    data_ranks: int = 1,
    *,
    stop_after: int | None = None,
    resume: bool = False,
) -> tuple[dict, GrimoireTrainer]:
    """3 SGD steps of ``family`` ("sft", "dpo", "kto", "grpo", "rloo"; "sft_checkpointed": SFT with
    activation checkpointing, whose recompute repeats the attention's collectives; "sft_fsdp2",
    "grpo_fsdp2": with ``distributed: fsdp2``) on packed
    rows through ``GrimoireTrainer`` (``stop_after``: that many, with a checkpoint there;
    ``resume``: from the latest checkpoint in ``OUT_DIR/<family>`` to step 3); the trained
    weights, the logged losses and the model's attention implementation, and the trainer (the
    caller closes the last one: that releases the process group)."""
    from tests.helpers.train_utils import quiet_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    seen: dict[str, list] = {}
    base = family.removesuffix("_fsdp2").removesuffix("_checkpointed")
    if base == "sft":
        rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(24, seed=5, max_len=9)]
        loss_fn: object = SFTLoss()
    elif base in ("grpo", "rloo"):
        rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(8, seed=6)]
        loss_fn, seen = online_method(base, sequence_parallel_size)
    elif base == "kto":  # its KL reference point: mismatched pairs, summed over data ranks
        rows = [tokenize_kto(r, tok, max_length=64) for r in kto_rows(16, seed=4)]
        loss_fn = KTOLoss(ref_model=copy.deepcopy(model))
    else:
        rows = [tokenize_preference(r, tok, max_length=64) for r in preference_rows(16, seed=4)]
        loss_fn = DPOLoss(ref_model=copy.deepcopy(model))
    config = quiet_config(
        out_dir / family,
        max_steps=stop_after or 3,
        save_steps=stop_after,
        resume_from_checkpoint="latest" if resume else None,
        # The same global batch whatever the data ranks: each reads its share.
        batch_size=(2 if base in ("grpo", "rloo") else 4) // data_ranks,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        optimizer="sgd",
        padding_free=True,
        gradient_checkpointing=family == "sft_checkpointed",
        distributed="fsdp2" if family.endswith("_fsdp2") else "ddp",
        sequence_parallel_size=sequence_parallel_size,
    )
    steps = StepsRun()
    trainer = GrimoireTrainer(model, tok, config, loss_fn, rows, callbacks=[steps])
    trainer.train()
    model = trainer.unwrapped_model
    trainer.accelerator.wait_for_everyone()  # the main process has written metrics.jsonl
    metrics = (out_dir / family / "metrics.jsonl").read_text().splitlines()
    state = full_state_dict(model) if is_sharded(model) else model.state_dict()
    result = {
        "params": {k: v.detach().clone() for k, v in state.items()},
        "losses": [json.loads(line)["loss"] for line in metrics],
        "tokens": [json.loads(line)["tokens"] for line in metrics],
        "attention": attention_impl(model),
        "steps_run": steps.steps,
        # FSDP2: the ranks of the mesh its parameters are sharded on (None: not sharded).
        "mesh": next(model.parameters()).device_mesh.mesh.tolist() if is_sharded(model) else None,
        **seen,
    }
    return result, trainer


def main(out_dir: Path, tiny_dir: str) -> None:
    """2 processes: one sequence group of 2 (the row split, greedy sampling, the trainer's
    :data:`FAMILIES`). 4 processes: one group of 4 (the row split, and the trainer's
    :data:`FAMILIES4`; the model's 2 key/value heads are repeated to 4), then greedy sampling
    from an FSDP2-sharded policy and the trainer's :data:`MESH_FAMILIES` on a 2 data x 2
    sequence mesh."""
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 2:
        split_rows(out_dir, "", sequence_mesh(2)[1], build_model("llama", seed=0))
        torch.save(greedy_samples(tiny_dir, sequence_mesh(2)[1]), out_dir / f"greedy.rank{rank}.pt")
        runs = [(f, 2, f) for f in FAMILIES]
        resume_across_sizes(tiny_dir, out_dir, Path(sys.argv[3]))
    else:
        split_rows(out_dir, "n4.", sequence_mesh(world)[1], build_model("llama", seed=0))
        runs = [(f, 4, f"n4.{f}") for f in FAMILIES4]
        mesh = sequence_mesh(2)[1]
        torch.save(
            greedy_samples(tiny_dir, mesh, sharded=True), out_dir / f"greedy.fsdp2.rank{rank}.pt"
        )
        runs += [(f, 2, f"mesh2x2.{f}") for f in MESH_FAMILIES]
    for family, size, name in runs:  # the trainer's own runs, on the same process group
        trained, trainer = train(tiny_dir, out_dir / name, family, size, data_ranks=world // size)
        torch.save(trained, out_dir / f"{name}.rank{rank}.pt")
    trainer.close()


#: The trainer's runs the 2-process launch makes (``sft_checkpointed``: SFT with activation
#: checkpointing).
FAMILIES = ("sft", "dpo", "kto", "sft_checkpointed", "grpo", "rloo")
#: The 4-process launch's: one sequence group of 4, then a 2 data x 2 sequence mesh.
FAMILIES4 = ("sft", "dpo", "grpo")
MESH_FAMILIES = ("grpo", "sft_fsdp2", "grpo_fsdp2")


def resume_across_sizes(tiny_dir: str, out_dir: Path, one_run: Path) -> None:
    """SFT under ``sequence_parallel_size: 2`` stopped at step 2 with a checkpoint in
    ``OUT_DIR/sp2_to_1`` (the test resumes it in one process), and the one-process run
    stopped at step 2 in ``one_run`` resumed here, under 2, to step 3 (its weights in
    ``OUT_DIR/one_to_sp2.rank<r>.pt``)."""
    train(tiny_dir, out_dir / "sp2_to_1", "sft", 2, stop_after=2)  # main closes the last
    trained, _ = train(tiny_dir, one_run, "sft", 2, resume=True)
    torch.save(trained, out_dir / f"one_to_sp2.rank{dist.get_rank()}.pt")


def split_rows(out_dir: Path, prefix: str, sp, ref: torch.nn.Module) -> None:
    """:data:`STEPS` SGD steps of the SFT NLL on packed rows split over ``sp``, against ``ref``
    scoring each document alone; writes ``OUT_DIR/<prefix>rank<r>.pt``."""
    torch.manual_seed(0)
    model = copy.deepcopy(ref)
    enable_ulysses_attention(model, sp.size)
    result: dict[str, list] = {k: [] for k in ("sp", "ref", "sp_full", "sp_entropy", "ref_entropy")}
    result.update(loss_sp=[], loss_ref=[], grads_sp=[], grads_ref=[])
    # What the model itself is given: this rank's slice, not the row.
    result["local_lengths"] = []
    model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: result["local_lengths"].append(args[0].shape[1])
    )
    opt_sp = torch.optim.SGD(model.parameters(), lr=LR)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    count = 0
    for step in range(STEPS):
        lengths = ROWS[step % len(ROWS)]
        ids, labels, positions = packed_row(lengths, seed=step)
        set_sequence_group(sp)
        out = compute_token_logps(model, ids, labels, position_ids=positions, uniform_grad=True)
        count = int(out.mask.sum())
        loss = nll(out.logps, count)
        loss.backward()
        sum_sequence_grads(model, sp)
        if step == 0:  # the full-logits path and the entropy too, once
            with torch.no_grad():
                full = compute_token_logps(
                    model, ids, labels, position_ids=positions, fused=False, return_entropy=True
                )
            result["sp_full"].append(full.logps)
            result["sp_entropy"].append(full.entropy)
            result["ref_entropy"].append(None)
        set_sequence_group(None)
        ref_logps, ref_entropy = reference_logps(ref, ids, labels, lengths)
        # Each document's targets: its tokens after the 2-token prompt.
        ref_loss = nll(ref_logps, sum(n - 2 for n in lengths))
        ref_loss.backward()
        if step == 0:
            result["ref_entropy"][0] = ref_entropy
        result["sp"].append(out.logps.detach())
        result["ref"].append(ref_logps.detach())
        result["loss_sp"].append(float(loss.detach()))
        result["loss_ref"].append(float(ref_loss.detach()))
        result["grads_sp"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        result["grads_ref"].append({n: p.grad.clone() for n, p in ref.named_parameters()})
        opt_sp.step()
        opt_ref.step()
        opt_sp.zero_grad()
        opt_ref.zero_grad()
    result["params_sp"] = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    result["params_ref"] = [{n: p.detach().clone() for n, p in ref.named_parameters()}]
    result["count"] = [count, sum(n - 2 for n in ROWS[(STEPS - 1) % len(ROWS)])]
    torch.save(result, out_dir / f"{prefix}rank{dist.get_rank()}.pt")
    dist.barrier()
    set_sequence_group(None)


def greedy_samples(tiny_dir: str, sp, sharded: bool = False) -> dict[str, list]:
    """The HF engine's greedy samples from a model with the Ulysses attention while the sequence
    group is active (rank 0 of the group samples, unsplit, with its KV cache, and sends them),
    and from the plain model with no group; and the held-out callbacks' greedy texts (every
    rank generates whole rows) both ways. ``sharded``: the split model is FSDP2-sharded over
    the data ranks as the trainer shards it (every rank samples, in step, ``synced_gpus``;
    the data ranks sample different prompts, as they would, and the callbacks are skipped)."""
    from functools import partial
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grimoire.config.context import all_reduce_max
    from grimoire.parallel.fsdp import shard_model
    from grimoire.rollout.engines.generation import greedy_generate_texts

    prompts = [[5, 9, 11, 3], [7, 2], [13, 8, 21]]
    if sharded and dist.get_rank() >= sp.size:  # the second data rank: 3 sampling calls, not 2
        prompts = [[4, 6], [17, 3, 9, 12, 30], [22], [9, 9], [31, 2, 5]]
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    out: dict[str, list] = {}
    for name in ("split", "plain"):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir)
        agree = None
        if name == "split":
            enable_ulysses_attention(model, sp.size)
        if name == "split" and sharded:  # as the trainer shards it: over the data ranks
            config = TrainingConfig(
                distributed="fsdp2", mixed_precision="no", sequence_parallel_size=sp.size
            )
            shard_model(model, config)
            agree = partial(
                all_reduce_max, SimpleNamespace(num_processes=dist.get_world_size(), device="cpu")
            )
        set_sequence_group(sp if name == "split" else None)
        engine = HFGenerateEngine(max_new_tokens=6, generation_batch_size=2)
        engine.bind(model, 0, None, agree=agree)
        rollout = engine.generate(prompts, 1, with_old_logps=False, greedy=True)
        out[name] = rollout.completion_ids.tolist()
        if not sharded:
            out[f"{name}_texts"] = greedy_generate_texts(model, tok, ["abc", "hello"], 5)
    set_sequence_group(None)
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
