"""mixed_precision="auto": bf16 where the hardware computes it natively, fp32 elsewhere, and a
warning for an explicit bf16 on a CPU that would run it ~30x slower (issue #16)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.helpers.train_utils import quiet_config, train

from grimoire import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.losses import SFTLoss
from grimoire.model import precision
from grimoire.model.precision import resolve_mixed_precision


def _flags_from_cpuinfo() -> set[str]:
    """Read independently of grimoire.model.precision: the x86 ``flags`` line."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _expected_cpu_precision() -> str:
    flags = _flags_from_cpuinfo()
    native = bool({"amx_bf16", "avx512_bf16"} & flags) and torch.backends.mkldnn.is_available()
    return "bf16" if native else "no"


@pytest.fixture
def on_cpu(monkeypatch):
    """Resolve as on a machine with no accelerator, also where the tests run on a GPU host."""
    import grimoire.training.setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "_other_accelerator", lambda: False)
    monkeypatch.setattr(
        grimoire.training.setup, "has_accelerator", lambda: False
    )  # train on the CPU


def _detected(monkeypatch, native: bool) -> None:
    fake = precision.CpuBf16(
        native=native,
        flags=("avx512_bf16",) if native else (),
        capability="AVX2" if not native else "AVX512",
        reason="test says so",
    )
    monkeypatch.setattr(precision, "detect_cpu_bf16", lambda: fake)


def test_auto_is_the_default_and_a_listed_choice():
    assert TrainingConfig().mixed_precision == "auto"
    with pytest.raises(ConfigError, match=r"mixed_precision='fp8' is not one of \['auto'"):
        TrainingConfig(mixed_precision="fp8")


def test_auto_matches_this_cpu(on_cpu, tmp_path):
    """On whatever CPU runs this: bf16 exactly when cpuinfo lists AMX-BF16 or AVX512-BF16."""
    config = TrainingConfig(output_dir=str(tmp_path))
    assert resolve_mixed_precision(config) == _expected_cpu_precision()


def test_auto_trains_in_the_detected_precision(on_cpu, tiny_model, tokenizer, sft_rows, tmp_path):
    """Observed in the model: a linear layer's output dtype during the training forward."""
    seen: list[torch.dtype] = []
    layer = tiny_model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        config = quiet_config(tmp_path, mixed_precision="auto", max_steps=1)
        trainer = train(tiny_model, tokenizer, sft_rows[:4], SFTLoss(), config)
    finally:
        handle.remove()
    expected = _expected_cpu_precision()
    assert trainer.accelerator.mixed_precision == expected
    assert seen and set(seen) == {torch.bfloat16 if expected == "bf16" else torch.float32}


def test_auto_is_fp32_without_native_bf16(on_cpu, monkeypatch):
    _detected(monkeypatch, native=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never warns: it picks the fast precision
        assert precision.resolve_auto("auto") == "no"


def test_auto_is_bf16_with_native_bf16(on_cpu, monkeypatch):
    _detected(monkeypatch, native=True)
    assert precision.resolve_auto("auto") == "bf16"


def test_explicit_bf16_without_native_support_warns_and_is_honoured(on_cpu, monkeypatch, tmp_path):
    _detected(monkeypatch, native=False)
    config = TrainingConfig(output_dir=str(tmp_path), mixed_precision="bf16")
    with pytest.warns(UserWarning, match=r"without native bf16.*30x slower"):
        assert resolve_mixed_precision(config) == "bf16"


def test_explicit_bf16_with_native_support_is_silent(on_cpu, monkeypatch):
    _detected(monkeypatch, native=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.resolve_auto("bf16") == "bf16"
        assert precision.resolve_auto("no") == "no"


def test_decision_is_logged_with_the_cpu_capability(on_cpu, monkeypatch, caplog):
    _detected(monkeypatch, native=False)
    with caplog.at_level("INFO", logger="grimoire.model.precision"):
        precision.resolve_auto("auto")
    assert "mixed_precision='auto' -> 'no'" in caplog.text
    assert "cpu capability AVX2" in caplog.text


def test_auto_on_cuda_follows_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.decide("auto", cuda=True)[0] == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert precision.decide("auto", cuda=True)[0] == "no"


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu sse avx2 avx512f avx512_bf16 avx512_vnni", True),
        ("fpu sse avx2 amx_bf16 amx_tile", True),
        ("fpu sse avx2 fma avx512f avx512bw", False),  # AVX512 alone: bf16 is emulated
    ],
)
def test_detection_reads_the_flags(monkeypatch, tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\n")
    assert precision.cpu_flags(str(cpuinfo)) == set(flags.split())
    monkeypatch.setattr(precision, "cpu_flags", lambda: set(flags.split()))
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert precision.detect_cpu_bf16.__wrapped__().native is native
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert precision.detect_cpu_bf16.__wrapped__().native is False


def test_unreadable_cpuinfo_means_no_native_bf16(monkeypatch, tmp_path):
    assert precision.cpu_flags(str(tmp_path / "absent")) == set()
    monkeypatch.setattr(precision, "cpu_flags", lambda: set())
    assert precision.detect_cpu_bf16.__wrapped__().native is False
