"""``grimoire estimate-memory``: will this run fit? Per-rank peak memory by part, from the config.

Usage::

    grimoire estimate-memory --config run.yaml [--world-size N] [--nodes M] [--hsdp]
                             [--shard-group-size S] [--device-memory 80] [--set KEY=JSON ...]
    grimoire estimate-memory --model path/to/config.json --world-size 8 --grid

Reads the ``grimoire train`` config (the model's ``config.json`` only, never its weights) and
prints the memory of one rank by part, the peak of each phase of a step and whether it fits a
``--device-memory`` GiB accelerator. ``--grid`` prints instead the table ``docs/multi-gpu.md``
shows: DDP, FSDP2, HSDP, CPU offload and LoRA, with and without activation checkpointing, for
the config's other settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from grimoire.config.loading import apply_overrides, read_yaml_file
from grimoire.errors import ConfigError
from grimoire.tools.common import ToolParser, run_tool
from grimoire.tools.memory.estimate import GIB, estimate
from grimoire.tools.memory.report import fit_grid, render, verdict
from grimoire.tools.memory.run_config import plan_from_config

#: Exit code when the run's estimated peak does not fit the device.
DOES_NOT_FIT = 2


def build_parser() -> ToolParser:
    p = ToolParser(
        prog="grimoire estimate-memory",
        description="Per-rank peak memory of a grimoire train config, by part (weights, "
        "gradients, optimizer states, activations, logits, reference model, rollout KV cache), "
        "read from the model's config.json without loading weights. Assumes CUDA GPUs; 'auto' "
        "settings resolve as on a bf16 GPU. See docs/multi-gpu.md.",
        example=[
            "grimoire estimate-memory --config run.yaml --world-size 8",
            "grimoire estimate-memory --config run.yaml --world-size 16 --nodes 2 --hsdp",
            "grimoire estimate-memory --model docs/memory/llama-3-8b.json --world-size 8 --grid",
        ],
    )
    p.add_argument("--config", help="the grimoire train YAML config")
    p.add_argument(
        "--model",
        help="model to size instead of the config's model.pretrained: a config.json file, a "
        "model folder, a hub name or tiny:<arch> (without --config: an SFT run of it)",
    )
    p.add_argument("--world-size", type=int, default=1, help="training processes (GPUs)")
    p.add_argument("--nodes", type=int, default=1, help="machines the processes are spread over")
    p.add_argument(
        "--shard-group-size",
        type=int,
        help="FSDP2: ranks one copy of the weights is sharded over (HSDP when < world size)",
    )
    p.add_argument(
        "--hsdp",
        action="store_true",
        help="FSDP2: shard within each node, replicate across nodes (shard group = world/nodes)",
    )
    p.add_argument("--device-memory", type=float, default=80.0, help="GiB per device (default 80)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override a dotted config key, as for grimoire train "
        "(e.g. training.gradient_checkpointing=false)",
    )
    p.add_argument(
        "--grid", action="store_true", help="the DDP / FSDP2 / HSDP / offload / LoRA fit table"
    )
    return p


def main(argv: Sequence[str]) -> int:
    """``grimoire estimate-memory``: returns the exit code."""
    parser = build_parser()

    def body() -> int:
        args = parser.parse_args(list(argv))
        if not args.config and not args.model:
            raise ConfigError(["give --config run.yaml (or --model config.json)"])
        for name in ("world_size", "nodes", "device_memory"):
            if getattr(args, name) <= 0:
                raise ConfigError([f"--{name.replace('_', '-')} must be > 0"])
        if args.world_size % args.nodes:
            raise ConfigError(
                [f"--world-size {args.world_size} is not a multiple of --nodes {args.nodes}"]
            )
        raw = read_yaml_file(args.config) if args.config else {}
        raw = apply_overrides(raw, args.overrides)
        group = args.shard_group_size
        if args.hsdp:
            group = args.world_size // args.nodes
        plan = plan_from_config(raw, args.world_size, group, model=args.model)
        device = args.device_memory * GIB
        if args.grid:
            print(f"{plan.shape.name}: {args.world_size} x {args.device_memory:g} GiB")
            print(fit_grid(plan.shape, plan.setup, args.nodes, device))
            return 0
        est = estimate(plan.shape, plan.setup)
        print(render(est, device, args.nodes, plan.tokens_from))
        # A script can stop before training a run that cannot fit (errors exit 1).
        return DOES_NOT_FIT if verdict(est.peak, device) == "does not fit" else 0

    return run_tool("estimate-memory", body)


__all__ = ["build_parser", "main"]
