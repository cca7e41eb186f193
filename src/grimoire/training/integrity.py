"""What makes a checkpoint trustworthy on disk: durable, checksummed, and said plainly when not.

- :func:`seal` is the last step of writing a checkpoint: every file is fsynced (so a machine
  crash after the rename cannot leave a folder that looks complete but holds lost pages), its
  size and CRC-32 go into ``manifest.json`` (read from the page cache the write just filled, in
  the same pass as the fsync), then the folders are fsynced; after the rename the parent folder
  is fsynced too (:func:`fsync_dir`), so the rename itself survives.
- :func:`damage` checks a checkpoint against its manifest: a missing, truncated or altered file
  is named. A checkpoint written before manifests existed passes unchecked.
- :func:`reported_write` turns a failed write (a full disk, a file-size limit, an I/O error, a
  permission) into ONE message naming the path, the error, the free space and the last
  complete checkpoint, and removes the half-written temporary folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from grimoire.errors import GrimoireError

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class WriteFailed(GrimoireError):
    """A save (checkpoint, export, metrics, run summary) could not be written."""


class CheckpointDamaged(GrimoireError):
    """A checkpoint's files do not match its manifest."""


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints in ``output_dir`` (renamed into place, so written to the end), oldest first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = re.fullmatch(rf"{PREFIX}(\d+)", p.name)
        if m and p.is_dir() and (p / STATE_FILE).exists():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def _crc_and_fsync(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        os.fsync(f.fileno())
    return size, crc


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(folder: Path) -> None:
    """fsync every file of ``folder``, write ``manifest.json`` (sizes and CRC-32s), fsync the
    folders; the caller renames ``folder`` into place and fsyncs its parent."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        size, crc = _crc_and_fsync(path)
        files[path.relative_to(folder).as_posix()] = {"size": size, "crc32": crc}
    manifest = folder / MANIFEST
    with open(manifest, "w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}, reverse=True):
        fsync_dir(sub)


def damage(folder: Path) -> str | None:
    """What is wrong with checkpoint ``folder`` against its manifest (the first damaged file,
    named), or None when it is complete (or predates manifests)."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return None
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest} cannot be read ({exc})"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path} has {size} bytes, the manifest says {want['size']} (truncated?)"
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        if crc != want["crc32"]:
            return f"{path} does not match its checksum in {MANIFEST} (altered or corrupted)"
    return None


def last_complete(output_dir: str | Path) -> Path | None:
    """The newest checkpoint in ``output_dir`` that :func:`damage` finds complete."""
    for path in reversed(list_checkpoints(output_dir)):
        if damage(path) is None:
            return path
    return None


def _write_error(text: str) -> bool:
    return any(s in text for s in ("PytorchStreamWriter", "unexpected pos", "os error", "Errno"))


def _free(path: Path) -> str:
    for where in (path, *path.parents):
        if where.exists():
            free = shutil.disk_usage(where).free
            return f"; the disk holding {where} has {free / 2**20:.1f} MiB free"
    return ""


@contextlib.contextmanager
def reported_write(
    what: str, path: Path, output_dir: str | Path, temporary: Path | None = None
) -> Iterator[None]:
    """Turn a failed write of ``what`` at ``path`` into :class:`WriteFailed` with one message;
    ``temporary``: a half-written folder to remove first. torch's writers report a full disk
    as a ``RuntimeError`` (``unexpected pos``), safetensors as its own error, DCP as a
    ``CheckpointException`` (a ``BaseException``) carrying each rank's: those are caught too."""
    try:
        yield
    except (OSError, RuntimeError, SafetensorError, CheckpointException) as exc:
        if isinstance(exc, RuntimeError) and not _write_error(str(exc)):
            raise
        rank = ""
        if isinstance(exc, CheckpointException) and exc.failures:  # each rank's (error, trace)
            first = min(exc.failures)
            rank, exc = f" (rank {first})", exc.failures[first][0]
        removed = ""
        if temporary is not None and temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
            removed = f" (its temporary folder {temporary} was removed)"
        reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else ""
        error = f"{type(exc).__name__}: {exc}"
        error += f" [{reason}]" if reason and reason not in error else ""
        if "unexpected pos" in error:  # torch's zip writer, when a write came up short
            error += " (torch's zip writer could not write it all: a full disk or a size limit)"
        full = (
            isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        ) or any(s in str(exc) for s in ("os error 28", "os error 27", "unexpected pos"))
        last = last_complete(output_dir)
        raise WriteFailed(
            f"could not write {what} to {path}{rank}: {error}{_free(Path(path))}{removed}. "
            f"The last complete checkpoint is {last or 'none (nothing to resume from yet)'}"
            + (
                "; resume from it with resume_from_checkpoint: latest once there is room"
                if last is not None or full
                else ""
            )
            + "."
        ) from exc


__all__ = [
    "MANIFEST",
    "PREFIX",
    "STATE_FILE",
    "CheckpointDamaged",
    "WriteFailed",
    "damage",
    "fsync_dir",
    "last_complete",
    "list_checkpoints",
    "reported_write",
    "seal",
]
