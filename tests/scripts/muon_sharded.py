"""Muon's step on FSDP2 shards against the same step on whole matrices, fed identical gradients.

Usage (2 processes): ``muon_sharded.py TINY_DIR OUT_DIR`` (or :func:`main` from a launched
script whose process group is up: tests/scripts/fsdp_parity.py with ``MUON_SHARDED=1``). Two copies of the tiny Llama: one
sharded by grimoire's ``shard_model`` (FSDP2), one left whole on every process, each with
``build_optimizer(optimizer="muon")``. Each step sets the same seeded full gradient on both
(the sharded copy gets this process's slice), steps both optimizers, and records, per Muon
matrix, the largest relative difference between the gathered sharded weights and the whole
ones, the parameter's and its momentum buffer's types and local shapes. The gradients are fed
rather than computed because Newton-Schulz runs in bf16: a reduction-order difference in a
computed gradient (FSDP2 vs one process, or DDP) flips bf16 roundings that the iteration then
amplifies far beyond 1e-5, which would hide what this script checks, the sharded step itself.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grimoire import TrainingConfig
from grimoire.optim.optimizers import build_optimizer
from grimoire.parallel.fsdp import shard_model

STEPS = 3


def main(tiny_dir: str, out: str) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    started = not dist.is_initialized()  # run alone, or after fsdp_parity.py's trainers
    if started:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = TrainingConfig(
        output_dir=out,
        optimizer="muon",
        distributed="fsdp2",
        mixed_precision="no",
        weight_decay=0.1,
        learning_rate=1e-3,
    )
    whole = AutoModelForCausalLM.from_pretrained(tiny_dir)
    sharded = shard_model(copy.deepcopy(whole), config)
    opt_whole, opt_sharded = build_optimizer(whole, config), build_optimizer(sharded, config)
    muon_ids = {id(p) for p in opt_sharded.param_groups[0]["params"]}
    pairs = list(zip(sharded.named_parameters(), whole.parameters(), strict=True))
    worst: dict[str, float] = {}
    for step in range(STEPS):
        for i, ((_, p), q) in enumerate(pairs):
            g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1000 * step + i))
            q.grad = g.clone()
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        opt_whole.step()
        opt_sharded.step()
        for (name, p), q in pairs:
            rel = ((p.full_tensor() - q).abs().max() / q.abs().max()).item()
            worst[name] = max(worst.get(name, 0.0), rel)
    record = {
        name: {
            "muon": id(p) in muon_ids,
            "type": type(p).__name__,
            "full": list(p.shape),
            "local": list(p.to_local().shape),
            "buffer": type(opt_sharded.state[p].get("momentum_buffer")).__name__,
            "max_rel_diff": worst[name],
        }
        for name, p in sharded.named_parameters()
    }
    Path(out, f"muon.rank{rank}.json").write_text(json.dumps(record))
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    if started:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
