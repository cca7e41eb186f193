"""The vLLM server engine's wire, without vLLM: weight frames, the chunked stream, and the
client against the real HTTP handler serving a stand-in sampler (records what it is sent).

The same client against a real ``grimoire vllm-serve`` is tested in tests/vllm_backend."""

from __future__ import annotations

import io

import pytest
import torch
from tests.helpers.stand_in_server import serving

from grimoire.errors import ConfigError
from grimoire.rollout.engines.backends import build_engine, engine_problems
from grimoire.rollout.engines.base import SamplerConfig
from grimoire.rollout.engines.vllm_server import (
    API_KEY_ENV,
    ChunkedReader,
    VLLMServerEngine,
    frame_problems,
    is_loopback,
    read_frames,
    weight_frames,
)
from grimoire.tools.vllm_serve import checkpoint_weights

TENSORS = [
    ("a.weight", torch.randn(3, 5)),
    ("b.bias", torch.randn(7).to(torch.bfloat16)),
    ("c.idx", torch.arange(4)),
    ("empty", torch.zeros(0, 2)),
]


def _same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_frames_round_trip_and_end_marker():
    data = b"".join(weight_frames(TENSORS))
    _same(list(read_frames(io.BytesIO(data))), TENSORS)
    assert list(read_frames(io.BytesIO(b"".join(weight_frames([]))))) == []
    with pytest.raises(ValueError, match="ended early"):  # a cut stream is an error, not a stop
        list(read_frames(io.BytesIO(data[:-20])))


def _chunked(data: bytes, size: int) -> bytes:
    """``data`` in HTTP/1.1 chunked encoding, chunks of ``size`` (one with an extension)."""
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    out = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts[:1])
    out += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts[1:])
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_chunked_reader_reassembles_frames_across_chunk_borders(size):
    data = b"".join(weight_frames(TENSORS))
    _same(list(read_frames(ChunkedReader(io.BytesIO(_chunked(data, size))))), TENSORS)


class StandIn:
    """What the handler calls on vLLM's side: records pushes; samples prompt[0] + k."""

    def __init__(self, config):
        self.config, self.pushed, self.requests = config, [], []

    def info(self):
        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        return {"ok": True, "config": {k: getattr(self.config, k) for k in keys}}

    def generate(self, request):
        self.requests.append(request)
        ids, logps = [], []
        for prompt, p in zip(request["prompts"], request["params"]):
            for k in range(p["n"]):
                ids.append([prompt[0] + k, prompt[0] + k + 1])
                logps.append([-0.5, -0.25])
        return {"ids": ids, "logps": logps}

    def load_weights(self, stream):
        self.pushed.append(list(read_frames(stream)))
        return {"ok": True}


@pytest.fixture
def served(tiny_model):
    stand_in = StandIn(tiny_model.config)
    with serving(stand_in) as url:
        yield stand_in, url


def test_client_pushes_the_policy_and_maps_the_samples(served, tiny_model, tokenizer):
    stand_in, url = served
    engine = VLLMServerEngine(max_new_tokens=4, temperature=0.7, top_k=3, url=url, seed=5)
    engine.bind(tiny_model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    rollout = engine.generate([[10, 11, 12], [20]], 2)
    # One push before the first rollout: the policy's state, every tensor (tied ones included).
    assert len(stand_in.pushed) == 1 and engine.syncs == 1
    want = dict(tiny_model.state_dict())
    got = dict(stand_in.pushed[0])
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # Sampling settings one to one, a seed per request; the stand-in's samples come back.
    params = stand_in.requests[0]["params"]
    assert [p["n"] for p in params] == [2, 2]
    assert {(p["temperature"], p["top_k"], p["max_tokens"]) for p in params} == {(0.7, 3, 4)}
    assert params[0]["stop_token_ids"] == [tokenizer.eos_token_id]
    assert params[0]["seed"] != params[1]["seed"]
    assert rollout.completion_ids[:, :2].tolist() == [[10, 11], [11, 12], [20, 21], [21, 22]]
    assert torch.allclose(rollout.sampler_logps[:, :2], torch.tensor([[-0.5, -0.25]] * 4))
    # No weight written: no second push; an optimizer step: a push.
    engine.generate([[10, 11, 12]], 2)
    assert len(stand_in.pushed) == 1
    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    tiny_model(
        input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])
    ).loss.backward()
    optimizer.step()
    engine.generate([[10, 11, 12]], 2)
    assert len(stand_in.pushed) == 2
    assert all(
        torch.equal(dict(stand_in.pushed[1])[k], v) for k, v in tiny_model.state_dict().items()
    )


def test_errors_before_training(served, tiny_model, tokenizer):
    _, url = served
    sampling = SamplerConfig(max_new_tokens=4)
    # No server there: named, with the command that starts one.
    engine = build_engine(
        {"type": "vllm-server", "args": {"url": "http://127.0.0.1:9", "timeout": 1}}, sampling
    )
    with pytest.raises(ConfigError, match="no server answered at http://127.0.0.1:9.*vllm-serve"):
        engine.bind(tiny_model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    # A server of another model: the differing keys named.
    other = type(tiny_model.config).from_dict({**tiny_model.config.to_dict(), "vocab_size": 999})
    engine = VLLMServerEngine(url=url)
    with pytest.raises(ConfigError, match="vocab_size is"):
        engine.bind(type(tiny_model)(other), tokenizer.pad_token_id, tokenizer.eos_token_id)
    # YAML checks: unknown argument, bad url.
    assert "unknown vllm-server engine argument" in " ".join(
        engine_problems({"type": "vllm-server", "args": {"ulr": url}})
    )
    with pytest.raises(ValueError, match="url must look like"):
        VLLMServerEngine(url="localhost:8000")


def test_vllm_serve_errors_are_one_line(tmp_path):
    """Without vLLM (the main suite): the install command; with it: the missing folder."""
    from tests.helpers.commands import grimoire_command, run

    from grimoire.rollout.engines.vllm_common import vllm_available

    argv = [*grimoire_command(), "vllm-serve", "--model", str(tmp_path / "nope")]
    res = run(argv, tmp_path, expect=1)
    want = "no such folder" if vllm_available() else "pip install 'grimoire[vllm]'"
    assert want in res.stderr and "Traceback" not in res.stderr


# --------------------------------------------------------------------------- access


@pytest.fixture
def keyed(tiny_model):
    stand_in = StandIn(tiny_model.config)
    with serving(stand_in, api_key="s3cret") as url:
        yield stand_in, url


def test_a_keyed_server_answers_only_the_trainer_with_its_key(
    keyed, tiny_model, tokenizer, monkeypatch
):
    stand_in, url = keyed
    ids = (tokenizer.pad_token_id, tokenizer.eos_token_id)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match="answered 401: this trainer sent no API key"):
        VLLMServerEngine(url=url, timeout=5).bind(tiny_model, *ids)
    with pytest.raises(ConfigError, match="answered 401: this trainer sent a wrong API key"):
        VLLMServerEngine(url=url, timeout=5, api_key="guess").bind(tiny_model, *ids)
    # A push without the key is refused before a byte of it is read: nothing loaded.
    engine = VLLMServerEngine(url=url, timeout=5, api_key="guess")
    with pytest.raises(PermissionError):
        engine._request("POST", "/weights", body=weight_frames(tiny_model.state_dict().items()))
    assert stand_in.pushed == [] and stand_in.requests == []
    monkeypatch.setenv(API_KEY_ENV, "s3cret")  # the trainer's key from the environment
    engine = VLLMServerEngine(max_new_tokens=4, url=url, timeout=5, seed=1)
    engine.bind(tiny_model, *ids)
    engine.generate([[10, 11]], 1)
    assert len(stand_in.pushed) == 1 and len(stand_in.requests) == 1


def test_the_server_refuses_a_public_address_without_a_key(tmp_path):
    from tests.helpers.commands import grimoire_command, run

    argv = [*grimoire_command(), "vllm-serve", "--model", str(tmp_path), "--host", "0.0.0.0"]
    res = run(argv, tmp_path, expect=1, **{API_KEY_ENV: ""})
    assert res.stderr.startswith("grimoire vllm-serve: --host 0.0.0.0 lets other machines reach")
    assert "--api-key" in res.stderr and "Traceback" not in res.stderr
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("0.0.0.0")


def test_pushed_frames_are_checked_against_the_served_checkpoint(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    expected = checkpoint_weights(tmp_path)
    frames = list(tiny_model.state_dict().items())
    tied = ["lm_head.weight"] if tiny_model.config.tie_word_embeddings else []
    assert frame_problems(frames, expected, tied) == []
    name, weight = frames[1]
    bad = [
        (name, weight[:1]),  # another shape
        ("model.extra.weight", weight),  # not in the served model
        (name, weight.to(torch.int64)),  # integers for a floating weight
        (name, weight.to(torch.bfloat16)),  # another floating dtype: vLLM casts, allowed
    ]
    problems = frame_problems(bad, expected, tied)
    assert problems == [
        f"{name}: shape [1, {weight.shape[1]}], the served model's {list(weight.shape)}",
        "model.extra.weight: not a weight of the served model",
        f"{name}: dtype torch.int64, the served model's torch.float32",
    ]
