"""Pieces the benchmark scripts share: memory readings, the machine line, the tiny model and
training settings, and running one measurement in a fresh subprocess.

The scripts run as ``python benchmarks/X.py`` (this folder is then ``sys.path[0]``) and may be
imported as ``benchmarks.X`` (the repository root on ``sys.path``), so they import this module as

    try:
        from benchmarks import common as bench
    except ModuleNotFoundError:  # run as a script
        import common as bench

Only the standard library is imported at the top; torch and grimoire inside the functions.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Training settings every trainer benchmark shares: one constant learning rate, fp32, no
#: dropout, no progress bar or epoch-end checkpoint, a log line each step.
TRAINING_DEFAULTS: dict[str, Any] = dict(
    learning_rate=1e-5,
    warmup_ratio=0.0,
    lr_scheduler="constant",
    mixed_precision="no",
    disable_dropout=True,
    progress_bar=False,
    save_on_epoch_end=False,
    logging_steps=1,
)


# --------------------------------------------------------------------------- memory


def status_mb(key: str) -> float:
    """A ``/proc/self/status`` size (``VmRSS``, ``VmHWM``, ...) in MiB; OSError where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise OSError(key)


def peak_mb() -> float:
    """Peak RSS since the last reset (``VmHWM``), in MiB; falls back to ``ru_maxrss``."""
    try:
        return status_mb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_during(fn: Callable[[], object]) -> dict[str, Any]:
    """Run ``fn`` and measure it: ``base_mb`` (RSS just before, after a GC), ``peak_mb`` (peak
    RSS during it, ``VmHWM`` reset first), ``delta_mb``, ``peak_reset`` (False: the peak also
    covers what came before) and ``seconds``."""
    gc.collect()
    base = status_mb("VmRSS")
    reset = reset_peak()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    peak = peak_mb()
    return {
        "base_mb": base,
        "peak_mb": peak,
        "delta_mb": peak - base,
        "peak_reset": reset,
        "seconds": seconds,
    }


def vocab_peak(vocab: int) -> Any:
    """A TorchDispatchMode (use it as a context manager) whose ``.rows`` ends as the most rows
    (``numel // vocab``) of any float tensor an op returned with last dim ``vocab`` and stride 1
    there: the largest logits block, observed on the ops themselves (a transposed view of the
    ``[V, H]`` head weight is excluded by its stride)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class VocabPeak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.vocab, self.rows = vocab, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                logits = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2
                if logits and t.shape[-1] == self.vocab and t.stride(-1) == 1:
                    self.rows = max(self.rows, t.numel() // self.vocab)
            return out

    return VocabPeak()


# --------------------------------------------------------------------------- set-up


def machine_line(cores_note: str = "", *, cpu_capability: bool = False, tail: str = "") -> str:
    """``# machine: CPU; [cpu capability X; ]N cores[cores_note]; RAM; torch; python[; tail]``."""
    import torch

    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            model = names[0]
    except OSError:
        pass
    try:
        mem = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        mem = "? RAM"
    parts = [model]
    if cpu_capability:
        parts.append(f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    parts += [f"{os.cpu_count()} cores{cores_note}", mem, f"torch {torch.__version__}"]
    parts.append(f"python {platform.python_version()}")
    if tail:
        parts.append(tail)
    return "# machine: " + "; ".join(parts)


def cpu_flags(prefixes: tuple[str, ...] = ("avx512", "amx")) -> list[str]:
    """The CPU's ``/proc/cpuinfo`` flags starting with one of ``prefixes`` (sorted; empty where
    unreadable): which of the wide-vector / matrix units torch's kernels may use here."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    flags = line.split(":", 1)[1].split() if ":" in line else []
    return sorted({f for f in flags if f.startswith(prefixes)})


def tiny_llama(
    vocab: int, hidden: int, layers: int, max_positions: int, heads: int | None = None
) -> Any:
    """A Llama built in code (seed 0, untied embeddings, fp32); ``heads`` attention heads (and
    as many key/value heads) instead of the tiny default."""
    from grimoire.model.tiny import build_model

    extra = {} if heads is None else {"num_attention_heads": heads, "num_key_value_heads": heads}
    return build_model(
        "llama",
        seed=0,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        tie_word_embeddings=False,
        max_position_embeddings=max_positions,
        **extra,
    )


def training_config(output_dir: str, **kw: Any) -> Any:
    """A ``TrainingConfig`` with ``TRAINING_DEFAULTS``, overridden and extended by ``kw``."""
    from grimoire import TrainingConfig

    return TrainingConfig(output_dir=output_dir, **{**TRAINING_DEFAULTS, **kw})


def reverse_warm_trainer(method: Any, config: Any, callbacks: list[Any]) -> Any:
    """A trainer of ``method`` on the bundled warm-started tiny Llama (``grimoire/assets/
    reverse_warm``, fp32) and the reverse task's training prompts (examples/grpo_toy.yaml's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grimoire
    from grimoire import GrimoireTrainer
    from grimoire.rows.prompts import tokenize_grpo

    assets = Path(grimoire.__file__).parent / "assets"
    tok = AutoTokenizer.from_pretrained(assets / "reverse_warm")
    lines = (assets / "reverse_train.jsonl").read_text().splitlines()
    return GrimoireTrainer(
        model=AutoModelForCausalLM.from_pretrained(assets / "reverse_warm", dtype=torch.float32),
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=[tokenize_grpo(json.loads(ln), tok, max_length=64) for ln in lines],
        callbacks=callbacks,
    )


# --------------------------------------------------------------------------- timing


class StepClock:
    """``on_step_end`` timestamps; the same callback protocol in both grimoires (wrap it in a
    ``transformers.TrainerCallback`` for TRL). On a GPU the step's queued kernels are waited for
    first, so a timestamp means the step is done."""

    def __init__(self, cuda: bool = False) -> None:
        self.times: list[float] = []
        self.cuda = cuda

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def __getattr__(self, name: str) -> Any:  # every other hook: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


# --------------------------------------------------------------------------- subprocesses


def child_env(*, repo_first: bool = True) -> dict[str, str]:
    """This process's environment with the repository's ``src`` and root on ``PYTHONPATH``:
    before the inherited entries (``repo_first``) or after them."""
    env = dict(os.environ)
    repo = [str(ROOT / "src"), str(ROOT)]
    inherited = [*filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(repo + inherited if repo_first else inherited + repo)
    return env


def free_port() -> int:
    """A TCP port free on this machine now (for a launch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(script: list[str], world: int) -> list[str]:
    """``script`` (a path and its arguments) as one plain ``python`` process for ``world`` 1,
    else under ``torch.distributed.run`` with ``world`` processes on a free port."""
    if world == 1:
        return [sys.executable, *script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    return cmd + ["--master-port", str(free_port()), *script]


def run_or_exit(
    cmd: list[str], what: str, env: dict[str, str] | None = None, *, brief: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with its output captured; where it fails, exit with ``{what} failed`` and its
    stderr (``brief``: the exit code and the last 4000 characters; else all of it)."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        if brief:
            sys.exit(f"{what} failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
        sys.exit(f"{what} failed:\n{out.stderr}")
    return out


def last_json(stdout: str) -> Any:
    """The JSON object on the last line a worker printed."""
    return json.loads(stdout.strip().splitlines()[-1])


def tool_task_curve(records: list[dict[str, Any]], window: int) -> dict[str, float]:
    """The tool-task benchmarks' learning curve from a run's metrics records: the mean sampled
    success (``rewards/exact_match_reward/mean``) and tool calls that ran (``tools/ok``) over
    the first and the last ``w`` logged steps (``w``: ``window``, at most half the steps)."""
    steps = [r for r in records if "rewards/exact_match_reward/mean" in r]
    rate = [r["rewards/exact_match_reward/mean"] for r in steps]
    calls = [r.get("tools/ok", 0.0) for r in steps]
    w = min(window, len(rate) // 2)
    return {
        "steps": float(len(rate)),
        "w": float(w),
        "rate_first": sum(rate[:w]) / w,
        "rate_last": sum(rate[-w:]) / w,
        "calls_first": sum(calls[:w]) / w,
        "calls_last": sum(calls[-w:]) / w,
    }
