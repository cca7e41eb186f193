"""The non-finite guard's cost per step: ``benchmarks/throughput.py``'s runs with the guard on
and with it taken out, interleaved in one invocation, each in a fresh subprocess.

Run: ``python benchmarks/guard_cost.py --impls "ours packed" --steps 10 --repeats 3`` (the flags
are throughput.py's; ``--tiny`` for its tiny model, where a step is shortest and the guard's
share largest). "Off" removes every piece of the guard from the run: the per-micro-batch
``isfinite`` mask (``mark_nonfinite``), the gradient-norm flag (``nonfinite``) and the host-side
decision (``NonFiniteGuard.check``); the step's one reduction and read stay. Printed per column:
the median seconds per timed step of each, and on/off (1.00: no cost; the spread of the
individual runs says how much of any difference this machine's noise can explain).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    from benchmarks import common as bench
    from benchmarks import throughput
except ModuleNotFoundError:  # run as a script
    import common as bench
    import throughput


def _guard_off() -> None:
    """Take the guard out of this process's trainer (the "off" runs only)."""
    from grimoire.training import step, trainer
    from grimoire.training.guard import NonFiniteGuard

    trainer.mark_nonfinite = lambda mask, loss, index, weight: mask
    step.nonfinite = lambda value, measured=False: 0.0
    NonFiniteGuard.check = lambda self, step, totals, loss: False


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    if not spec.pop("guard"):
        _guard_off()
    return throughput.worker(spec)


def run(impl: str, guard: bool, args: Any, model: Path) -> float:
    """Seconds per timed step of one run in a fresh process."""
    spec = {
        "impl": impl,
        "precision": args.precisions[0],
        "model": str(model),
        "out": "",
        "rows": args.steps * args.batch,
        "batch": args.batch,
        "max_len": args.max_len,
        "max_tokens": args.max_tokens,
        "vocab": args.spec["vocab_size"],
        "seed": args.seed,
        "warmup": args.warmup,
        "threads": args.threads,
        "device": args.device,
        "cudnn": args.cudnn,
        "pad_multiple": args.pad_multiple,
        "guard": guard,
    }
    spec["out"] = tempfile.mkdtemp(prefix="guard-cost-")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    result = bench.last_json(bench.run_or_exit(cmd, impl, bench.child_env()).stdout)
    return result["seconds"] / result["timed_steps"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = throughput.parse(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    impls = [i for i in args.impls if i.startswith("ours")] or ["ours packed"]
    print(bench.machine_line(tail=f"threads {args.threads}, precision {args.precisions[0]}"))
    model = throughput.save_model(Path(tempfile.mkdtemp(prefix="guard-model-")), args.spec)
    times: dict[tuple[str, bool], list[float]] = {(i, g): [] for i in impls for g in (True, False)}
    for _ in range(args.repeats):  # interleaved: on, off, on, off ...
        for impl in impls:
            for guard in (True, False):
                times[impl, guard].append(run(impl, guard, args, model))
    out = {}
    print(f"{'column':<14} {'on s/step':>10} {'off s/step':>11} {'on/off':>7}  runs (on | off)")
    for impl in impls:
        on, off = (statistics.median(times[impl, g]) for g in (True, False))
        runs = " ".join(f"{t:.3f}" for t in times[impl, True]) + " | "
        runs += " ".join(f"{t:.3f}" for t in times[impl, False])
        print(f"{impl:<14} {on:>10.4f} {off:>11.4f} {on / off:>7.3f}  {runs}")
        out[impl] = {"on": times[impl, True], "off": times[impl, False], "ratio": on / off}
    return out


if __name__ == "__main__":
    main()
