"""``grimoire vllm-serve``: serve a model's sampling to trainers using ``engine: vllm-server``.

Usage::

    grimoire vllm-serve --model path/to/policy [--host 127.0.0.1] [--port 8000] [--api-key K]

One vLLM ``LLM`` in this process, behind a small HTTP server that answers one request at a
time (``GET /health``, ``POST /generate``, ``POST /weights``, ``POST /adapter``; the format is in
:mod:`grimoire.rollout.engines.vllm_server`). Samples are token ids with the drawn tokens' log-probs;
``/weights`` loads a pushed weight stream into vLLM (``reload_weights``) and drops the prefix
cache; with ``--max-lora-rank`` (vLLM started with LoRA on), ``/adapter?id=N&config=JSON``
takes a LoRA adapter's tensors in the same stream format and samples with it from then on (the
base weights stay). Everything decoded is JSON or ``safetensors`` (no pickle).

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
import shutil
import tempfile
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, BinaryIO, cast

from grimoire.config.model_shape import SHAPE_KEYS
from grimoire.errors import GrimoireError
from grimoire.rollout.engines.vllm_common import completions, llm_args, lora_args, require_vllm
from grimoire.rollout.engines.vllm_server import (
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

    def __init__(self, model: str, max_lora_rank: int = 0, **settings: Any):
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
        #: LoRA adapters served (``--max-lora-rank``; 0: off): pushed to ``/adapter``.
        self.max_lora_rank = int(max_lora_rank)
        kwargs = llm_args(self.config, model=model, **settings)
        if self.max_lora_rank:
            kwargs.update(lora_args(self.max_lora_rank))
        self.llm = LLM(**kwargs)
        self.pushes = 0
        self.adapter_pushes = 0
        self.lora_request: Any = None
        self._adapters = tempfile.TemporaryDirectory(prefix="grimoire-serve-lora-")
        #: The served checkpoint's {name: (shape, dtype)}: what a push is checked against.
        self.expected = checkpoint_weights(Path(model))
        self.tied = ["lm_head.weight"] if getattr(self.config, "tie_word_embeddings", False) else []

    def info(self) -> dict[str, Any]:
        config = {k: getattr(self.config, k, None) for k in SHAPE_KEYS}
        config["model_type"] = self.config.model_type
        return {
            "ok": True,
            "config": config,
            "weight_pushes": self.pushes,
            "adapter_pushes": self.adapter_pushes,
            "max_lora_rank": self.max_lora_rank,
        }

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        prompts, params = request["prompts"], request["params"]
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling settings")
        outputs = self.llm.generate(
            [{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
            [SamplingParams(**p) for p in params],
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        with_logps = all(p.get("logprobs") is not None for p in params)
        ids, logps = completions(outputs, with_logps=with_logps)
        return {"ids": ids, "logps": logps if with_logps else None}

    def load_weights(self, stream: Any) -> dict[str, Any]:
        # Received whole (one host copy) and checked before vLLM loads any of it.
        frames = list(read_frames(stream))
        problems = frame_problems(frames, self.expected, self.tied) if self.expected else []
        if problems:
            raise ValueError(
                f"weights not loaded ({len(problems)} problems): " + "; ".join(problems[:20])
            )
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter(frames), "is_checkpoint_format": True},
        )
        # Full weights are the whole policy: a trainer syncing adapters pushes one next.
        self._drop_adapter()
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.pushes += 1
        return {"ok": True, "tensors": len(frames), "weight_pushes": self.pushes}

    def load_adapter(self, adapter_id: int, config: dict[str, Any], stream: Any) -> dict[str, Any]:
        """A pushed LoRA adapter (its ``adapter_config.json`` fields and its tensors, peft's
        names) saved as ``save_pretrained`` does and served from now on (named after the
        trainer's ``adapter_id``, numbered by the server); the one before it is dropped."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.max_lora_rank:
            raise ValueError("this server serves no LoRA adapters: start it with --max-lora-rank")
        frames = dict(read_frames(stream))
        problems = [f"{n}: not a LoRA weight" for n in frames if ".lora_" not in n]
        ranks = [int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())]
        if max(ranks) > self.max_lora_rank or min(ranks) < 1:
            problems.append(f"rank {max(ranks)} is not in 1..{self.max_lora_rank}")
        if problems:
            raise ValueError(f"adapter not loaded: {'; '.join(problems[:20])}")
        folder = Path(self._adapters.name) / f"v{self.adapter_pushes + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(frames, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        self._drop_adapter()
        # The server's own ids: trainers (runs, ranks) number their adapters independently.
        self.lora_request = LoRARequest(
            f"policy-{adapter_id}", self.adapter_pushes + 1, str(folder)
        )
        self.llm.llm_engine.add_lora(self.lora_request)
        self.llm.reset_prefix_cache()
        self.adapter_pushes += 1
        return {"ok": True, "tensors": len(frames), "adapter_pushes": self.adapter_pushes}

    def _drop_adapter(self) -> None:
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
            self.lora_request = None


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
_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def _load_pushed(sampler: Sampler, path: str, query: str, stream: Any) -> dict[str, Any]:
    """A ``/weights`` push (full weights), or an ``/adapter?id=N&config=JSON`` one."""
    if path == "/weights":
        return sampler.load_weights(stream)
    q = urllib.parse.parse_qs(query)
    config = json.loads(q["config"][0])
    if not isinstance(config, dict):
        raise ValueError("config: not a JSON object")
    return sampler.load_adapter(int(q["id"][0]), config, stream)


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
            path, _, query = self.path.partition("?")
            try:
                if path == "/generate":
                    size = int(self.headers.get("Content-Length", 0))
                    result = sampler.generate(json.loads(self.rfile.read(size)))
                elif path in ("/weights", "/adapter"):
                    chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
                    # rfile is the socket's buffered binary reader (typeshed: BufferedIOBase).
                    rfile = cast(BinaryIO, self.rfile)
                    stream = ChunkedReader(rfile) if chunked else rfile
                    result = _load_pushed(sampler, path, query, stream)
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


#: The command-line options handed on to :class:`Sampler` as they are.
_SAMPLER_ARGS = (
    "dtype",
    "seed",
    "max_model_len",
    "gpu_memory_utilization",
    "enforce_eager",
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "max_lora_rank",
)


def build_parser() -> ToolParser:
    """``grimoire vllm-serve``'s options."""
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
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (another than loopback needs --api-key)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"shared secret every request must carry "
        f"(default: ${API_KEY_ENV}); trainers pass it as the engine's args.api_key",
    )
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="vLLM's weights")
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", default=None)
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=0,
        help="serve LoRA adapters up to this rank, pushed by trainers with lora_sync: "
        "adapter (0: off)",
    )
    return p


def main(argv: Sequence[str]) -> int:
    """``grimoire vllm-serve``: returns the exit code (serves until interrupted)."""
    p = build_parser()

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
        sampler = Sampler(args.model, **{k: getattr(args, k) for k in _SAMPLER_ARGS})
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


__all__ = ["Sampler", "build_parser", "handler", "main"]
