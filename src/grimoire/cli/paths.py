"""What a config points at outside itself, checked before anything loads: model and tokenizer
folders or hub names, and the checkpoint to resume from.

``from_pretrained`` reads a string that is not an existing folder as a hub repository id, so a
mistyped local path would end deep in transformers (``OSError: Repo id must be in the form
'repo_name' ...``). Here a name is either an existing folder (checked for the files a model or
tokenizer needs), a hub name of the ``org/name`` shape (offline: it must be in the local cache),
or a problem that says which key, where the path was looked for, and what to give instead.
"""

from __future__ import annotations

import functools
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from grimoire.cli.model import REF_MODEL_COPY, TINY_PREFIX
from grimoire.model.gguf import gguf_problems, is_gguf_name
from grimoire.rows.sources import PACKAGE_PREFIX, hub_offline, resolve_path
from grimoire.training.checkpoint import STATE_FILE, damaged_message, list_checkpoints
from grimoire.training.integrity import damage

#: Files ``AutoTokenizer.from_pretrained`` reads a tokenizer from (any one is enough).
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
#: Files that make a folder a saved model: a full model, or a LoRA adapter on its base.
MODEL_FILES = ("config.json", "adapter_config.json")
#: A Windows drive (``C:``) or a path written with backslashes: never a hub name.
_WINDOWS_PATH = re.compile(r"^[A-Za-z]:|\\")


def looks_local(name: str) -> bool:
    """True when ``name`` can only mean a local path (``./x``, ``../x``, ``/x``, ``~/x``,
    ``grimoire://x``, ``a/b/c``, a Windows path), never a hub repository id."""
    return (
        name in (".", "..")
        or name.startswith(("./", "../", "/", "~", PACKAGE_PREFIX))
        or bool(_WINDOWS_PATH.search(name))
        or name.count("/") > 1
    )


def is_hub_name(name: str) -> bool:
    """True for the shape of a hub repository id (``gpt2``, ``Qwen/Qwen2.5-0.5B``)."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_cache_has(repo_id: str, cache_dir: str | None = None) -> bool:
    """True when the local Hugging Face cache holds a snapshot of model ``repo_id``."""
    root = Path(cache_dir or hub_constants.HF_HUB_CACHE).expanduser()
    snapshots = root / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def pretrained_problems(
    name: str,
    where: str,
    kind: str = "model",
    needs_tokenizer: bool = False,
    cache_dir: str | None = None,
    gguf_file: str | None = None,
) -> list[str]:
    """Problems with one ``from_pretrained`` name: ``model.pretrained``, ``model.tokenizer`` or
    ``loss.ref_model`` (``kind`` is ``"model"`` or ``"tokenizer"``).

    ``needs_tokenizer``: the tokenizer is read from this model folder too (no
    ``model.tokenizer``), so the folder must hold one. A GGUF file (``*.gguf``,
    ``grimoire://models/...``, or a folder with ``gguf_file``) holds both; its header is checked.
    """
    if name.startswith(TINY_PREFIX):
        return []  # built in code; the architecture is checked with the model section
    if is_gguf_name(name, gguf_file):
        return gguf_problems(name, where, gguf_file)
    path = resolve_path(name)
    if path.is_dir():
        return _folder_problems(path, where, kind, needs_tokenizer)
    if path.exists():
        return [
            f"{where}: {path} is a file; give the folder that holds the {kind}'s files (or a "
            ".gguf file)"
        ]
    instead = (
        "an existing model folder (e.g. one that grimoire train saved to save_to), a hub name "
        "such as Qwen/Qwen2.5-0.5B, or tiny:llama"
        if kind == "model"
        else "a folder that holds a tokenizer, or a hub name such as Qwen/Qwen2.5-0.5B"
    )
    if looks_local(name) or not is_hub_name(name):
        return [
            f"{where}: folder not found: {name} (relative to the current "
            f"directory, {Path.cwd()}); give {instead}"
        ]
    if hub_offline() and not hub_cache_has(name, cache_dir):
        cache = cache_dir or hub_constants.HF_HUB_CACHE
        return [
            f"{where}: {name!r} is no folder here ({Path.cwd()}), and as a hub name it is not in "
            f"the local Hugging Face cache ({cache}) while offline mode is on (HF_HUB_OFFLINE): "
            f"download it once with network access (hf download {name}), or give a local folder"
        ]
    if not hub_cache_has(name, cache_dir):
        down = hub_unreachable()
        if down is not None:
            return [
                f"{where}: {name!r} is no folder here ({Path.cwd()}) and not in the local Hugging "
                f"Face cache, and the hub cannot be reached ({down}): connect to the network, "
                "give a local folder, or set HF_HUB_OFFLINE=1 to use only cached models"
            ]
    return []  # a hub name: fetched (or read from the cache) when the run starts


#: Seconds the hub's host may take to accept a connection before it counts as unreachable.
HUB_PROBE_TIMEOUT = 5.0


@functools.lru_cache(maxsize=4)
def hub_unreachable(endpoint: str | None = None) -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``) cannot be reached, or None when it can.

    One TCP connection with a short timeout, made before any download: without it a model name
    with the network down ends in huggingface_hub's retries (a dozen log lines over a minute)
    before the one-line error.
    """
    url = urlsplit(endpoint or hub_constants.ENDPOINT)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT):
            return None
    except OSError as exc:
        return f"{url.scheme}://{host}:{port}: {exc.strerror or type(exc).__name__}"


def _folder_problems(path: Path, where: str, kind: str, needs_tokenizer: bool) -> list[str]:
    has = [f for f in (*MODEL_FILES, *TOKENIZER_FILES) if (path / f).is_file()]
    if kind == "model" and not any(f in has for f in MODEL_FILES):
        return [
            f"{where}: {path} holds no config.json, so it is not a saved model (save_pretrained "
            "and grimoire train's save_to write one; a training run's checkpoint-<step> folders "
            "are resumed with training.resume_from_checkpoint instead)"
        ]
    if (kind == "tokenizer" or needs_tokenizer) and not any(f in has for f in TOKENIZER_FILES):
        fix = (
            "set model.tokenizer to the tokenizer's folder or hub name"
            if kind == "model"
            else "give the folder that holds the tokenizer files"
        )
        return [f"{where}: {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); {fix}"]
    return []


def resume_problems(spec: Any, output_dir: Any = None) -> list[str]:
    """Problems with ``training.resume_from_checkpoint`` (``"latest"`` or a checkpoint folder),
    its files checked against the checkpoint's manifest as the resume will."""
    where = "training.resume_from_checkpoint"
    if spec == "latest" and isinstance(output_dir, str):
        damaged = []  # newest first, up to the first complete one ("latest" falls back to it)
        for found in reversed(list_checkpoints(Path(output_dir).expanduser())):
            if (why := damage(found)) is None:
                break
            damaged.append(f"{found.name} ({why})")
        else:
            if damaged:
                return [f"{where}: 'latest' finds only damaged checkpoints: {'; '.join(damaged)}"]
    if not isinstance(spec, str) or spec == "latest":
        return []  # the type is TrainingConfig's check; "latest" may find none (a fresh start)
    path = Path(spec).expanduser()
    if (path / STATE_FILE).is_file():
        why = damage(path)
        return [] if why is None else [f"{where}: {damaged_message(spec, path, why)}"]
    found = [p.name for p in list_checkpoints(path)]
    if found:  # an output_dir: say which checkpoints it holds
        return [
            f"{where}: {path} is a run's output folder, not one checkpoint; give one of its "
            f"checkpoints ({', '.join(found[-3:])}), or 'latest' with training.output_dir: {path}"
        ]
    what = (
        f"{path} is not a checkpoint (no {STATE_FILE})"
        if path.is_dir()
        else f"folder not found: {spec} (relative to the current directory, {Path.cwd()})"
    )
    return [
        f"{where}: {what}; give a checkpoint-<step> folder written by an earlier run, or "
        "'latest' for the newest one in training.output_dir (a fresh start when it has none)"
    ]


def reference_problems(raw: Mapping[str, Any]) -> list[str]:
    """Every path and hub name the (canonical, type-checked) config points at."""
    p: list[str] = []
    model = raw.get("model")
    if isinstance(model, Mapping):
        kwargs = model.get("model_kwargs")
        cache_dir = kwargs.get("cache_dir") if isinstance(kwargs, Mapping) else None
        cache_dir = cache_dir if isinstance(cache_dir, str) else None
        tokenizer = model.get("tokenizer")
        if isinstance(model.get("pretrained"), str) and model["pretrained"]:
            p += pretrained_problems(
                model["pretrained"],
                "model.pretrained",
                needs_tokenizer=not tokenizer,
                cache_dir=cache_dir,
                gguf_file=model.get("gguf_file")
                if isinstance(model.get("gguf_file"), str)
                else None,
            )
        if isinstance(tokenizer, str) and tokenizer:
            p += pretrained_problems(tokenizer, "model.tokenizer", "tokenizer", cache_dir=cache_dir)
        loss = raw.get("loss")
        ref = loss.get("ref_model") if isinstance(loss, Mapping) else None
        if isinstance(ref, str) and ref and ref != REF_MODEL_COPY:
            p += pretrained_problems(ref, "loss.ref_model", cache_dir=cache_dir)
    training = raw.get("training")
    if isinstance(training, Mapping):
        p += resume_problems(training.get("resume_from_checkpoint"), training.get("output_dir"))
    return p


__all__ = [
    "MODEL_FILES",
    "TOKENIZER_FILES",
    "hub_cache_has",
    "is_hub_name",
    "looks_local",
    "pretrained_problems",
    "reference_problems",
    "resume_problems",
]
