"""Start a (multi-process) training job from Python, the way orchestrators do.

``launch(config, nproc_per_node=N)`` runs ``torchrun ... -m grimoire.cli.main --config ...`` in a
subprocess, streams its output to the caller and to a log file, and returns the exit status; a
failed worker raises :class:`LaunchError` carrying the last lines it printed.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml


class LaunchError(RuntimeError):
    """A launched job exited non-zero; ``last_lines`` is the tail of its output."""

    def __init__(self, returncode: int, last_lines: list[str], log_file: Path):
        self.returncode = returncode
        self.last_lines = last_lines
        self.log_file = log_file
        tail = "".join(last_lines)
        super().__init__(
            f"training job failed with exit code {returncode} (log: {log_file}):\n{tail}"
        )


def launch(
    config: str | Path | Mapping[str, Any],
    nproc_per_node: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    overrides: Sequence[str] = (),
    log_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    stream: TextIO | None = sys.stdout,
    tail_lines: int = 40,
) -> int:
    """Run a Grimoire training job under torchrun and wait for it.

    Args:
        config: a YAML path, or the config itself as a mapping (written to a temporary YAML).
        nproc_per_node / nnodes / node_rank / master_addr / master_port: torchrun's settings.
        overrides: ``--set`` overrides, e.g. ``["training.max_steps=10"]``.
        log_file: where the combined output is also written (default
            ``<output_dir>/launch.log``, or a temporary file).
        env: extra environment variables for the workers.
        stream: where output lines are echoed as they arrive (None = silent).

    Returns:
        0 on success. Raises :class:`LaunchError` (with the last ``tail_lines`` lines) otherwise.
    """
    config_path, output_dir = _config_file(config)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        "-m",
        "grimoire.cli.main",
        "train",
        "--config",
        str(config_path),
    ]
    for item in overrides:
        cmd += ["--set", item]
    if log_file is None:
        folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="grimoire-"))
        log_file = folder / "launch.log"
    log_path = Path(log_file)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail.append(line)
            if stream is not None:
                stream.write(line)
        code = proc.wait()
    if code != 0:
        raise LaunchError(code, list(tail), log_path)
    return 0


def _config_file(config: str | Path | Mapping[str, Any]) -> tuple[Path, str | None]:
    if isinstance(config, Mapping):
        output_dir = (config.get("training") or {}).get("output_dir")
        folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="grimoire-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "launch_config.yaml"
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        return path, str(folder)
    path = Path(config)
    raw = yaml.safe_load(path.read_text()) or {}
    return path, (raw.get("training") or {}).get("output_dir")
