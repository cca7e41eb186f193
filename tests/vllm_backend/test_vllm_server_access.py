"""``grimoire vllm-serve --api-key`` with real vLLM: who may push weights, and what a push may be.

A server started with a key answers 401 to a request without it or with another key, and the
trainer's client (:class:`VLLMServerEngine`) turns that into one clear error at ``bind``, before
training. A weight push whose frames do not fit the served model (an unknown name, another
shape, an integer tensor for a floating weight) is refused with a 400 naming the frame, and
nothing of it is loaded: the bad frame comes LAST, after every real weight changed, so a server
that loaded frames as they arrived would now generate differently. Greedy generation (ids and
log-probs) is the same after the refused pushes as before; the same changed weights pushed
without the bad frame do change it (the check is not vacuous).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.parse

import pytest
import torch
from safetensors.torch import load_file
from tests.vllm_backend.common import start_server
from tests.vllm_backend.test_vllm_ddp import _env
from transformers import AutoModelForCausalLM

from grimoire.errors import ConfigError
from grimoire.rollout.engines.vllm_server import API_KEY_ENV, VLLMServerEngine, weight_frames

KEY = "s3cret-for-the-test"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def keyed(vllm_tiny):
    env = {k: v for k, v in _env().items() if k != API_KEY_ENV}
    proc, url = start_server(vllm_tiny, env, "--api-key", KEY)
    yield url
    proc.terminate()
    proc.wait(timeout=60)


def _raw(url: str, method: str, path: str, key: str | None, body: bytes = b"") -> tuple[int, dict]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    try:
        # The server answers 401 before reading the body: a large one can meet a closed socket.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request(method, path, body=body or None, headers=headers)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def _client(url: str, key: str | None, monkeypatch) -> VLLMServerEngine:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    return VLLMServerEngine(max_new_tokens=8, url=url, timeout=60, api_key=key)


def _greedy(engine: VLLMServerEngine) -> dict:
    params = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    body = json.dumps({"prompts": PROMPTS, "params": [params] * len(PROMPTS)}).encode()
    return engine._request("POST", "/generate", body=body)


def _pushes(engine: VLLMServerEngine) -> int:
    return engine._request("GET", "/health")["weight_pushes"]


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no-key", "wrong-key"])
def test_a_request_without_the_key_is_refused_401_and_the_trainer_says_so(
    vllm_tiny, keyed, monkeypatch, key
):
    # One real frame: small enough to sit in the socket's buffers when the 401 closes it.
    norm = load_file(vllm_tiny / "model.safetensors")["model.norm.weight"]
    frames = b"".join(weight_frames([("model.norm.weight", norm * 2)]))
    for method, path, body in [
        ("GET", "/health", b""),
        ("POST", "/weights", frames),
        ("POST", "/generate", b"{}"),
    ]:
        status, answer = _raw(keyed, method, path, key, body)
        assert status == 401 and "API key" in answer["error"], (method, path, status, answer)
    assert _raw(keyed, "GET", "/health", KEY)[0] == 200
    engine = _client(keyed, key, monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny)
    with pytest.raises(ConfigError) as refused:
        engine.bind(model, pad_token_id=0, eos_token_id=1)
    message = str(refused.value)
    assert "the vLLM server refused this trainer (nothing was trained)" in message
    how = "no" if key is None else "a wrong"
    assert f"/health answered 401: this trainer sent {how} API key" in message
    assert f"--api-key as the engine's args.api_key or in ${API_KEY_ENV}" in message
    assert _pushes(_client(keyed, KEY, monkeypatch)) == 0  # nothing was pushed


def _changed(vllm_tiny) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: tensor + 0.5 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in load_file(vllm_tiny / "model.safetensors").items()
    }


BAD_FRAMES = {
    "name": lambda w: ("model.layers.0.mlp.not_a_weight", w["model.norm.weight"]),
    "shape": lambda w: ("model.norm.weight", torch.ones(w["model.norm.weight"].numel() + 1)),
    "dtype": lambda w: ("model.norm.weight", torch.ones_like(w["model.norm.weight"]).long()),
}
WHAT = {
    "name": "model.layers.0.mlp.not_a_weight: not a weight of the served model",
    "shape": "model.norm.weight: shape [129], the served model's [128]",
    "dtype": "model.norm.weight: dtype torch.int64, the served model's torch.float32",
}


def test_a_bad_weight_frame_is_refused_before_anything_is_loaded(vllm_tiny, keyed, monkeypatch):
    engine = _client(keyed, KEY, monkeypatch)
    before, pushes = _greedy(engine), _pushes(engine)
    assert before["ids"] and all(before["ids"]) and before["logps"]
    changed = _changed(vllm_tiny)
    for kind, bad in BAD_FRAMES.items():
        frames = weight_frames([*changed.items(), bad(changed)])  # every real weight first
        with pytest.raises(RuntimeError) as refused:
            engine._request("POST", "/weights", body=frames)
        message = str(refused.value)
        assert "/weights answered 400" in message and "weights not loaded (1 problems)" in message
        assert WHAT[kind] in message, message
        assert _pushes(engine) == pushes, kind
        assert _greedy(engine) == before, kind  # the served weights are as they were
    engine._request("POST", "/weights", body=weight_frames(changed.items()))
    assert _pushes(engine) == pushes + 1
    assert _greedy(engine) != before  # the same weights, loaded, do change the samples
    original = load_file(vllm_tiny / "model.safetensors")
    engine._request("POST", "/weights", body=weight_frames(original.items()))
    assert _greedy(engine) == before
