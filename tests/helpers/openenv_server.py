"""An OpenEnv server in its own process, served as OpenEnv's environments are (``uvicorn
module:app``), on 127.0.0.1 and a port the OS picks; stopped after."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.commands import ROOT

READY = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


@dataclass
class Server:
    """A running server: its URL, its process and every line it logged so far."""

    url: str
    process: subprocess.Popen
    log: list[str] = field(default_factory=list)

    def stop(self, grace: float = 10.0) -> None:
        """Terminates the process (a real fault when a test does it mid-run); killed when it
        is not gone after ``grace`` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start(
    app: str, cwd: Path = ROOT, app_dir: str | None = None
) -> tuple[subprocess.Popen, queue.Queue, list[str]]:
    """Starts ``uvicorn app`` (``module:app``, importable from ``cwd`` or its ``app_dir``) on
    port 0; its log is read by a thread into a list (the pipe never fills) and, line by line,
    a queue."""
    where = ["--app-dir", app_dir] if app_dir else []
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", *where, app, "--host", "127.0.0.1", "--port", "0"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    log: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            log.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return process, lines, log


def wait_ready(
    process: subprocess.Popen, lines: queue.Queue, log: list[str], timeout=60.0
) -> Server:
    """The server once uvicorn says where it listens; stops it and raises if it does not
    within ``timeout`` seconds or exits first."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"the OpenEnv server exited: {''.join(log)[-2000:]}")
            if found := READY.search(line):
                return Server(found.group(1), process, log)
        raise RuntimeError(f"the OpenEnv server was not up in {timeout}s: {''.join(log)[-2000:]}")
    except BaseException:
        process.kill()
        process.wait(timeout=10)
        raise


@contextmanager
def serving(*apps: str, cwd: Path = ROOT, app_dir: str | None = None) -> Iterator[list[Server]]:
    """One server per ``module:app`` of ``apps``, started side by side; all stopped after."""
    started = [start(app, cwd, app_dir) for app in apps]
    servers: list[Server] = []
    try:
        for process, lines, log in started:
            servers.append(wait_ready(process, lines, log))
        yield servers
    finally:
        for process, _, _ in started:  # a step may still sleep: no need to wait for it
            Server("", process).stop(grace=2.0)
