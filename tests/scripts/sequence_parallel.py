"""Ulysses sequence parallelism against one process, on one packed row (run under torchrun).

Usage: ``torchrun --nproc-per-node N sequence_parallel.py OUT_DIR TINY_DIR``. Every rank scores
the same
packed row of several documents, one crossing the slice boundary, with the row split over the
sequence group (``grimoire.forward.logprobs.compute_token_logps`` on a model with
``grimoire_ulysses`` attention), and independently without any collective: each document alone
through the plain sdpa model, log-softmax of its full logits. It then runs ``STEPS`` SGD steps of
the SFT token-mean NLL both ways. Writes ``OUT_DIR/rank<r>.pt`` with both sides' numbers.

Then the trainer itself: :func:`train` runs 3 steps of SFT and of DPO with
``sequence_parallel_size = N`` (the whole world one sequence group, so one data rank), writing
``OUT_DIR/<family>.pt`` (rank 0: the trained weights, the losses, the attention implementation);
the test runs the same :func:`train` in one process.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grimoire import GrimoireTrainer
from grimoire.columns import IGNORE_INDEX
from grimoire.data import tokenize_preference, tokenize_sft
from grimoire.forward.attention_hints import attention_impl
from grimoire.forward.logprobs import compute_token_logps
from grimoire.forward.sequence_split import set_sequence_group
from grimoire.losses import DPOLoss, SFTLoss
from grimoire.model.tiny import build_model, preference_rows, reverse_rows
from grimoire.model.ulysses_attention import enable_ulysses_attention
from grimoire.parallel.sequence import sequence_mesh, sum_sequence_grads

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


def nll(logps: torch.Tensor, count: int) -> torch.Tensor:
    return -logps.sum() / count


def train(
    tiny_dir: str, out_dir: Path, family: str, sequence_parallel_size: int
) -> tuple[dict, GrimoireTrainer]:
    """3 SGD steps of ``family`` ("sft", "dpo", or "sft_checkpointed": SFT with activation
    checkpointing, whose recompute repeats the attention's collectives) on packed rows through
    ``GrimoireTrainer``;
    the trained weights, the logged losses and the model's attention implementation, and the
    trainer (the caller closes the last one: that releases the process group)."""
    from tests.helpers.train_utils import quiet_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    if family.startswith("sft"):
        rows = [tokenize_sft(r, tok, max_length=64) for r in reverse_rows(24, seed=5, max_len=9)]
        loss_fn: object = SFTLoss()
    else:
        rows = [tokenize_preference(r, tok, max_length=64) for r in preference_rows(16, seed=4)]
        loss_fn = DPOLoss(ref_model=copy.deepcopy(model))
    config = quiet_config(
        out_dir / family,
        max_steps=3,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        optimizer="sgd",
        padding_free=True,
        gradient_checkpointing=family == "sft_checkpointed",
        sequence_parallel_size=sequence_parallel_size,
    )
    trainer = GrimoireTrainer(model, tok, config, loss_fn, rows)
    trainer.train()
    model = trainer.unwrapped_model
    trainer.accelerator.wait_for_everyone()  # the main process has written metrics.jsonl
    metrics = (out_dir / family / "metrics.jsonl").read_text().splitlines()
    result = {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": [json.loads(line)["loss"] for line in metrics],
        "tokens": [json.loads(line)["tokens"] for line in metrics],
        "attention": attention_impl(model),
    }
    return result, trainer


def main(out_dir: Path, tiny_dir: str) -> None:
    dist.init_process_group("gloo")
    _, sp = sequence_mesh(dist.get_world_size())
    torch.manual_seed(0)
    ref = build_model("llama", seed=0)
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
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(result, out_dir / f"rank{rank}.pt")
    dist.barrier()
    set_sequence_group(None)
    for family in (
        "sft",
        "dpo",
        "sft_checkpointed",
    ):  # the trainer's own runs, on the same process group
        trained, trainer = train(tiny_dir, out_dir, family, world)
        torch.save(trained, out_dir / f"{family}.rank{rank}.pt")
    trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
