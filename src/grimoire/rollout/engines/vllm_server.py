"""The vLLM server backend: a ``grimoire vllm-serve`` process samples; the trainer trains.

Stage: rollout (see docs/architecture.md). :class:`VLLMServerEngine` is the client: it sends
prompts (token ids) and sampling settings over HTTP and pushes the policy's weights after every
optimizer step that changed them. The training process needs no vLLM; the server can run on
other devices (or another machine) than the trainer, as with TRL's ``trl vllm-serve``.

The wire format is plain and safe to decode: JSON for requests and samples, and for weights a
stream of frames (8-byte little-endian length, then one tensor as ``safetensors`` bytes: no
pickle), sent with chunked transfer encoding so neither side holds more than one tensor of the
stream; an empty frame ends it. :func:`weight_frames` / :func:`read_frames` are the two ends.

Access: a server started with an API key (``--api-key`` or the ``VLLM_API_KEY`` environment
variable, as vLLM's own server) answers only requests carrying ``Authorization: Bearer <key>``;
the client sends its ``api_key`` (default: the same environment variable) and a refused key is
a :class:`~grimoire.errors.ConfigError` at :meth:`VLLMServerEngine.bind`, before training.
Pushed weight frames are checked (names, shapes, dtypes) against the served model before any
is loaded (:func:`frame_problems`).

Several ranks: each rank sends its own prompts (the server serves one request at a time). Every
rank walks the policy's weights (under FSDP2 each gather is a collective), rank 0 alone sends
them, and all ranks wait for the push before sampling again, so no rank samples with the
weights of the step before.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import ipaddress
import json
import os
import struct
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import Tensor

from grimoire.config.model_shape import SHAPE_KEYS
from grimoire.errors import ConfigError
from grimoire.rollout.engines.vllm_common import VLLMSamplerEngine, plain_model
from grimoire.rollout.engines.vllm_weights import lora_rank

_FRAME = struct.Struct("<Q")
#: The environment variable holding the shared secret (vLLM's own server reads the same one).
API_KEY_ENV = "VLLM_API_KEY"


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def authorized(header: str | None, api_key: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``api_key`` (always, when there is none);
    compared in constant time."""
    if not api_key:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {api_key}".encode())


def frame_problems(
    frames: Iterable[tuple[str, Tensor]],
    expected: dict[str, tuple[tuple[int, ...], str]],
    tied: Iterable[str] = (),
) -> list[str]:
    """What in pushed weight ``frames`` does not fit the served model's ``expected``
    ``{name: (shape, dtype)}`` (its checkpoint's): unknown names (``tied`` ones allowed), other
    shapes, a non-floating tensor for a floating weight or the reverse (a floating dtype may
    differ: vLLM casts to its own)."""
    problems = []
    for name, tensor in frames:
        if name not in expected:
            if name not in set(tied):
                problems.append(f"{name}: not a weight of the served model")
            continue
        shape, dtype = expected[name]
        if tuple(tensor.shape) != tuple(shape):
            problems.append(f"{name}: shape {list(tensor.shape)}, the served model's {list(shape)}")
        if tensor.dtype.is_floating_point != getattr(torch, dtype).is_floating_point:
            problems.append(f"{name}: dtype {tensor.dtype}, the served model's torch.{dtype}")
    return problems


def weight_frames(weights: Iterable[tuple[str, Tensor]]) -> Iterator[bytes]:
    """One frame per ``(name, tensor)`` (length, then ``safetensors`` bytes), then the end."""
    from safetensors.torch import save

    for name, tensor in weights:
        data = save({name: tensor.detach().cpu().contiguous()})
        yield _FRAME.pack(len(data)) + data
    yield _FRAME.pack(0)


def read_frames(stream: BinaryIO) -> Iterator[tuple[str, Tensor]]:
    """The ``(name, tensor)`` pairs of a :func:`weight_frames` stream, one at a time."""
    from safetensors.torch import load

    while True:
        head = _read_exactly(stream, _FRAME.size)
        (size,) = _FRAME.unpack(head)
        if size == 0:
            return
        yield from load(_read_exactly(stream, size)).items()


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ValueError(f"weight stream ended early: wanted {size} bytes, got {len(data)}")
    return data


class ChunkedReader:
    """``read(n)`` over an HTTP/1.1 chunked request body (the server's side of the stream)."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.buffer, self.done = raw, b"", False

    def read(self, size: int) -> bytes:
        while len(self.buffer) < size and not self.done:
            line = self.raw.readline().split(b";")[0].strip()
            length = int(line, 16)
            if length == 0:
                self.raw.readline()  # the empty trailer line
                self.done = True
                break
            self.buffer += self.raw.read(length)
            self.raw.readline()  # the chunk's CRLF
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data


class VLLMServerEngine(VLLMSamplerEngine):
    """Samples with a ``grimoire vllm-serve`` server at ``url``; see the module docstring.

    Args (besides the sampler settings every engine takes, and ``seed``,
    ``importance_sampling``, ``importance_sampling_cap``:
    :class:`~grimoire.rollout.engines.vllm_common.VLLMSamplerEngine`):
        url: the server's address, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds to wait for the server to answer at :meth:`bind` (it may still be
            starting) and for any one request.
        api_key: the server's shared secret; default: the ``VLLM_API_KEY`` environment variable.
    """

    def __init__(
        self,
        *,
        url: str = "http://127.0.0.1:8000",
        timeout: float = 300.0,
        api_key: str | None = None,
        **settings: Any,
    ):
        super().__init__(**settings)
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"VLLMServerEngine: url must look like http://HOST:PORT, got {url!r}")
        self.url, self.timeout = url, timeout
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.host: str = parsed.hostname
        self.port = parsed.port or 80

    # ------------------------------------------------------------------ set-up

    def _connect(self) -> None:
        """Wait for the server and check it serves the bound model."""
        info = self._wait_for_server()
        problems = _model_mismatch(info, self.policy)
        served_rank = int(info.get("max_lora_rank") or 0)
        if self.adapter_sync and served_rank < lora_rank(self.policy):
            problems.append(
                f"lora_sync: adapter needs a server started with --max-lora-rank >= "
                f"{lora_rank(self.policy)} (the policy's LoRA rank); it has "
                f"{served_rank or 'LoRA off'}. Restart it so, or set lora_sync: merged"
            )
        if problems:
            raise ConfigError(
                [f"engine: vllm-server at {self.url}: {p}" for p in problems],
                title="the vLLM server serves another model (nothing was trained)",
            )

    def _wait_for_server(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._request("GET", "/health")
            except PermissionError as exc:
                raise ConfigError(
                    [f"engine: vllm-server at {self.url}: {exc}"],
                    title="the vLLM server refused this trainer (nothing was trained)",
                ) from exc
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        [
                            f"engine: vllm-server: no server answered at {self.url} within "
                            f"{self.timeout:.0f} s ({type(exc).__name__}: {exc}); start one with "
                            "`grimoire vllm-serve --model <the policy's folder>` or fix args.url"
                        ],
                        title="the vLLM server is not reachable (nothing was trained)",
                    ) from exc
                time.sleep(1.0)

    # ------------------------------------------------------------------ weights

    def _push_weights(self, weights: Iterator[tuple[str, Tensor]]) -> None:
        """Send weights to the server (rank 0; every rank walks them: FSDP2 gathers are
        collective)."""
        sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not sharded or dist.get_rank() == 0:
            self._request("POST", "/weights", body=weight_frames(weights))
        else:
            for _ in weights:
                pass
        if sharded:  # no rank samples before the server holds this step's weights
            dist.barrier()

    def _push_adapter(self, adapter_id: int, folder: Path) -> None:
        """Send the adapter saved in ``folder`` (its config in the query, its tensors as weight
        frames) to ``/adapter`` (rank 0; the others wait for it)."""
        sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not sharded or dist.get_rank() == 0:
            from safetensors.torch import load_file

            config = (folder / "adapter_config.json").read_text()
            query = urllib.parse.urlencode({"id": adapter_id, "config": config})
            tensors = load_file(str(folder / "adapter_model.safetensors"))
            self._request("POST", f"/adapter?{query}", body=weight_frames(tensors.items()))
        if sharded:
            dist.barrier()

    # ------------------------------------------------------------------ sampling

    def _draw(
        self, prompts: list[list[int]], n: int, greedy: bool, with_logps: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        params = [self.request_args(p, n, greedy) for p in prompts]
        body = json.dumps({"prompts": prompts, "params": params}).encode()
        out = self._request("POST", "/generate", body=body)
        return out["ids"], out["logps"] if with_logps else []

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        """One request on a fresh connection (the server answers one at a time); the JSON
        answer, or a ``RuntimeError`` with the server's own message."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            # A generator body goes out with chunked transfer encoding (http.client's choice for
            # a body of unknown length): one weight frame at a time.
            stream = body is not None and not isinstance(body, bytes)
            kind = "application/octet-stream" if stream else "application/json"
            headers = {"Content-Type": kind}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            # The server may answer (a 401) before reading the body: then read its answer.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status == 401:
            how = "a wrong" if self.api_key else "no"
            raise PermissionError(
                f"{self.url}{path} answered 401: this trainer sent {how} API key; pass the "
                f"server's --api-key as the engine's args.api_key or in ${API_KEY_ENV}"
            )
        if response.status != 200:
            raise RuntimeError(
                f"vLLM server {self.url}{path} answered {response.status}: "
                f"{data.decode(errors='replace')[:2000]}"
            )
        return json.loads(data)


def _model_mismatch(info: dict[str, Any], model: torch.nn.Module) -> list[str]:
    """What differs between the server's model and the policy (shape-defining config keys)."""
    config = plain_model(model).config.get_text_config(decoder=True)
    served = info.get("config", {})
    keys = (*SHAPE_KEYS, "model_type")
    return [
        f"{k} is {served.get(k)!r} there, {getattr(config, k, None)!r} in the policy"
        for k in keys
        if k in served and served.get(k) != getattr(config, k, None)
    ]


__all__ = [
    "API_KEY_ENV",
    "ChunkedReader",
    "VLLMServerEngine",
    "authorized",
    "frame_problems",
    "is_loopback",
    "read_frames",
    "weight_frames",
]
