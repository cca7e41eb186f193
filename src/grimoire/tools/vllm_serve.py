"""``grimoire vllm-serve``: serve a model's sampling to trainers using ``engine: vllm-server``.

Usage::

    grimoire vllm-serve --model path/to/policy [--host 127.0.0.1] [--port 8000] [--api-key K]

One vLLM ``LLM`` in this process, behind a small HTTP server that answers one request at a
time (``GET /health``, ``POST /generate``, ``POST /weights``; the format is in
:mod:`grimoire.rollout.vllm_server`). Samples are token ids with the drawn tokens' log-probs;
``/weights`` loads a pushed weight stream into vLLM (``reload_weights``) and drops the prefix
cache. Everything decoded is JSON or ``safetensors`` (no pickle).

Access: with ``--api-key`` (or ``VLLM_API_KEY`` in the environment) every request must carry
``Authorization: Bearer <key>`` (else 401); binding to an address other machines reach without
a key is refused, since whoever reaches the port could replace the policy that generates every
rollout, or read it. Pushed weights are checked against the served checkpoint (names, shapes,
dtypes) before any is loaded, so a push from another model changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, BinaryIO, cast

from grimoire.config.model_shape import SHAPE_KEYS
from grimoire.errors import GrimoireError
from grimoire.rollout.vllm_common import completions, llm_args, require_vllm
from grimoire.rollout.vllm_server import (
    API_KEY_ENV,
    ChunkedReader,
    authorized,
    frame_problems,
    is_loopback,
    read_frames,
)
from grimoire.tools.common import DTYPES, ToolParser, run_tool

log = logging.getLogger(__name__)


class Sampler:
    """The vLLM side of the server: start, sample, load weights (no HTTP here)."""

    def __init__(self, model: str, **settings: Any):
        from transformers import AutoConfig

        # A path (not a hub name "org/name") that is not there: say so, not the hub's complaint.
        looks_like_path = model.startswith((".", "/")) or model.count("/") > 1
        if looks_like_path and not Path(model).exists():
            raise GrimoireError(f"--model {model}: no such folder")
        try:
            config = AutoConfig.from_pretrained(model)
        except Exception as exc:
            raise GrimoireError(f"--model {model}: not a model folder or name ({exc})") from exc
        # In process, so /weights hands vLLM the received tensors as they arrive.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.config = config.get_text_config(decoder=True)
        if settings.get("dtype", "auto") == "auto":  # the checkpoint's own (vLLM's auto may cast)
            saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            settings["dtype"] = str(saved or "float32").removeprefix("torch.")
        self.llm = LLM(**llm_args(self.config, model=model, **settings))
        self.pushes = 0
        #: The served checkpoint's {name: (shape, dtype)}: what a push is checked against.
        self.expected = checkpoint_weights(Path(model))
        self.tied = ["lm_head.weight"] if getattr(self.config, "tie_word_embeddings", False) else []

    def info(self) -> dict[str, Any]:
        config = {k: getattr(self.config, k, None) for k in SHAPE_KEYS}
        config["model_type"] = self.config.model_type
        return {"ok": True, "config": config, "weight_pushes": self.pushes}

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        prompts, params = request["prompts"], request["params"]
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling settings")
        outputs = self.llm.generate(
            [{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
            [SamplingParams(**p) for p in params],
            use_tqdm=False,
        )
        with_logps = all(p.get("logprobs") is not None for p in params)
        ids, logps = completions(outputs, with_logps=with_logps)
        return {"ids": ids, "logps": logps if with_logps else None}

    def load_weights(self, stream: Any) -> dict[str, Any]:
        # Received whole (one host copy) and checked before vLLM loads any of it.
        frames = list(read_frames(stream))
        problems = frame_problems(frames, self.expected, self.tied) if self.expected else []
        if problems:
            raise ValueError(f"weights not loaded ({len(problems)} problems): " + "; ".join(
                problems[:20]))  # fmt: skip
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter(frames), "is_checkpoint_format": True},
        )
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.pushes += 1
        return {"ok": True, "tensors": len(frames), "weight_pushes": self.pushes}


def checkpoint_weights(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` of a model folder's safetensors files (headers only); empty
    for a hub name or a folder without them (pushes are then not checked)."""
    from safetensors import safe_open

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                piece = f.get_slice(name)
                out[name] = (
                    tuple(piece.get_shape()),
                    _DTYPE_NAMES.get(piece.get_dtype(), "float32"),
                )
    return out


#: safetensors' dtype names -> torch's.
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "BOOL": "bool"}  # fmt: skip


def handler(sampler: Sampler, api_key: str | None = None) -> type[BaseHTTPRequestHandler]:
    """The request handler class serving ``sampler`` (errors answered as 400/500 + message);
    with ``api_key``, every request without it is answered 401 before anything is read."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _refused(self) -> bool:
            if authorized(self.headers.get("Authorization"), api_key):
                return False
            self._answer(401, {"error": "missing or wrong API key (Authorization: Bearer ...)"})
            return True

        def do_GET(self) -> None:
            if self._refused():
                return
            if self.path != "/health":
                return self._answer(404, {"error": f"no such path {self.path}"})
            self._answer(200, sampler.info())

        def do_POST(self) -> None:
            if self._refused():
                return
            try:
                if self.path == "/generate":
                    size = int(self.headers.get("Content-Length", 0))
                    result = sampler.generate(json.loads(self.rfile.read(size)))
                elif self.path == "/weights":
                    chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
                    # rfile is the socket's buffered binary reader (typeshed: BufferedIOBase).
                    rfile = cast(BinaryIO, self.rfile)
                    stream = ChunkedReader(rfile) if chunked else rfile
                    result = sampler.load_weights(stream)
                else:
                    return self._answer(404, {"error": f"no such path {self.path}"})
            except (ValueError, KeyError, TypeError) as exc:
                return self._answer(400, {"error": f"{type(exc).__name__}: {exc}"})
            except Exception as exc:  # the server keeps serving; the client gets the message
                log.exception("request %s failed", self.path)
                return self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})
            self._answer(200, result)

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


def main(argv: Sequence[str]) -> int:
    """``grimoire vllm-serve``: returns the exit code (serves until interrupted)."""
    p = ToolParser(
        prog="grimoire vllm-serve",
        description="Serve a model's sampling with vLLM to trainers whose online method uses "
        "engine: vllm-server (they push their weights after each optimizer step). The trainer "
        'side: --set \'loss.args.engine={"type": "vllm-server", "args": {"url": '
        '"http://127.0.0.1:8000"}}\'.',
        example=(
            "grimoire vllm-serve --model output/sft/final --port 8000",
            'grimoire vllm-serve --model output/sft/final --host 10.0.0.5 --api-key "$SECRET"',
        ),
    )
    p.add_argument("--model", required=True, help="the policy's folder (or hub name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (another than "
                   "loopback needs --api-key)")  # fmt: skip
    p.add_argument("--api-key", default=None, help=f"shared secret every request must carry "
                   f"(default: ${API_KEY_ENV}); trainers pass it as the engine's args.api_key")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="vLLM's weights")
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", default=None)

    def body() -> int:
        args = p.parse_args(list(argv))
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        if api_key is None and not is_loopback(args.host):
            raise GrimoireError(
                f"--host {args.host} lets other machines reach this server, and without a key "
                "anyone who can would replace the policy's weights or read them: pass --api-key "
                f"(or set {API_KEY_ENV}) and give the trainer the same key, or keep 127.0.0.1"
            )
        require_vllm("grimoire vllm-serve")  # before loading anything
        sampler = Sampler(
            args.model,
            dtype=args.dtype,
            seed=args.seed,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            max_num_seqs=args.max_num_seqs,
        )
        server = HTTPServer((args.host, args.port), handler(sampler, api_key))
        host, port = server.server_address[:2]  # --port 0: a free port, printed here
        print(f"grimoire vllm-serve: serving {args.model} at http://{host}:{port}", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        return 0

    return run_tool("vllm-serve", body)


__all__ = ["Sampler", "handler", "main"]
