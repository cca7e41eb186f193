"""The real HTTP handler of ``grimoire vllm-serve`` serving a stand-in sampler (no vLLM), on a
free local port, for the vllm-server engine's tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import HTTPServer
from typing import Any

from grimoire.tools.vllm_serve import handler


@contextmanager
def serving(sampler: Any, **options: Any) -> Iterator[str]:
    """Serve ``sampler`` (what the handler calls: ``info``, ``generate``, ``load_weights``) in
    a thread, ``options`` for the handler (e.g. ``api_key``); yields its URL, shuts it down
    after."""
    server = HTTPServer(("127.0.0.1", 0), handler(sampler, **options))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def serving_turns(model_dir: Any) -> Iterator[tuple[Any, str]]:
    """A :class:`~tests.helpers.episodes.TurnSampler` for the tiny model in ``model_dir``
    (turns of the letters x, y, z), served; yields ``(sampler, url)``."""
    from tests.helpers.episodes import TurnSampler
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sampler = TurnSampler(
        AutoConfig.from_pretrained(model_dir), tok.convert_tokens_to_ids(list("xyz"))
    )
    with serving(sampler) as url:
        yield sampler, url
