"""Registry: short names, import specs, did-you-mean, import failures, laziness."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grimoire.config import registry
from grimoire.config.registry import CALLBACKS, LOSSES, TOKENIZERS, resolve
from grimoire.errors import ConfigError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_short_name_resolves_to_registered_object():
    from grimoire.losses.sft import SFTLoss
    from grimoire.rows.sft import tokenize_sft

    assert resolve("sft", LOSSES, "loss.type") is SFTLoss
    assert resolve("sft", TOKENIZERS, "dataset.tokenize.type") is tokenize_sft


def test_spec_resolves_including_dotted_attribute():
    from grimoire.losses.sft import SFTLoss

    assert resolve("grimoire.losses.sft:SFTLoss", LOSSES, "loss.type") is SFTLoss
    # A spec is used even when it is not registered, and may walk attributes.
    assert resolve("os.path:join", {}, "x") is os.path.join
    assert resolve("collections:OrderedDict.fromkeys", {}, "x").__name__ == "fromkeys"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("grimoire.rollout.calculator:calculator", "grimoire.rollout.agents.calculator:calculator"),
        (
            "grimoire.rollout.tool_calls:parse_tiny",
            "grimoire.rollout.agents.tool_parsers:parse_tiny",
        ),
        (
            "grimoire.rollout.reward_answers:AnswerMatch",
            "grimoire.rollout.rewards.answers:AnswerMatch",
        ),
        (
            "grimoire.rollout.reward_shaping:ThinkFormat",
            "grimoire.rollout.rewards.shaping:ThinkFormat",
        ),
        (
            "grimoire.rollout.reward_model:RewardModelReward",
            "grimoire.rollout.rewards.reward_model:RewardModelReward",
        ),
        (
            "grimoire.rollout.rewards:exact_match_reward",
            "grimoire.rollout.rewards.scoring:exact_match_reward",
        ),
    ],
)
def test_a_spec_of_a_built_ins_former_module_still_resolves(old, new):
    # A YAML file written with the module paths rollout/ had before its split keeps working.
    assert resolve(old, {}, "loss.args.tools[0]") is resolve(new, {}, "loss.args.tools[0]")


def test_unknown_name_suggests_and_lists_known_names():
    with pytest.raises(ConfigError) as info:
        resolve("sfft", LOSSES, "loss.type")
    msg = str(info.value)
    assert "loss.type" in msg and "'sfft'" in msg
    assert 'did you mean "sft"' in msg
    assert "known: " in msg and "sft" in msg.split("known: ")[1]


def test_missing_module_names_spec_and_underlying_error():
    with pytest.raises(ConfigError) as info:
        resolve("no_such_pkg_xyz.mod:Thing", LOSSES, "loss.type")
    msg = str(info.value)
    assert "'no_such_pkg_xyz.mod:Thing'" in msg and "ModuleNotFoundError" in msg
    assert isinstance(info.value.__cause__, ImportError)


def test_missing_attribute_names_spec_and_attribute_error():
    with pytest.raises(ConfigError) as info:
        resolve("grimoire.losses.sft:NoSuchLoss", LOSSES, "loss.type")
    assert "AttributeError" in str(info.value) and "NoSuchLoss" in str(info.value)


def test_registered_name_with_broken_spec_says_which_name(monkeypatch):
    monkeypatch.setitem(registry.LOSSES, "broken", "grimoire.losses.sft:Missing")
    with pytest.raises(ConfigError, match="registered as 'broken'"):
        resolve("broken", registry.LOSSES, "loss.type")


@pytest.mark.parametrize("bad", ["", ":Name", "module:", None, 3])
def test_malformed_specs_are_config_errors(bad):
    with pytest.raises(ConfigError):
        resolve(bad, LOSSES, "loss.type")


@pytest.mark.parametrize(
    ("table", "name"),
    [(t, n) for t in (LOSSES, TOKENIZERS, CALLBACKS) for n in sorted(t)],
)
def test_every_registered_entry_imports(table, name):
    # Guards the one-line additions other modules make: a typo in a spec fails here.
    assert callable(resolve(name, table, "registry"))


def test_importing_the_registry_imports_nothing_heavy():
    code = "import sys, grimoire.config.registry; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
