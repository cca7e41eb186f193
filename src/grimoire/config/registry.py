"""Every short name a config can pick, in one place: losses, tokenizers, rollout engines,
tool-call parsers, reward functions and callbacks.

Each registry maps a short name to a lazy ``"package.module:Name"`` spec string, so importing
this module imports nothing heavy; the target is imported only when :func:`resolve` is called.
Adding a method is one line, e.g. ``LOSSES["dpo"] = "grimoire.losses.dpo:DPOLoss"``.

Besides short names, :func:`resolve` accepts any ``package.module:Name`` spec (``Name`` may be a
dotted attribute path such as ``Outer.Inner``). **Importing a user's spec runs that module's
code, by design**: a config that names ``mypkg.losses:MyLoss`` is asking Grimoire to execute
``mypkg.losses``. Only run configs you trust, exactly as you would only run scripts you trust.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from grimoire.errors import ConfigError, did_you_mean

#: ``loss.type`` -> loss class (instantiated with ``loss.args``).
LOSSES: dict[str, str] = {
    "sft": "grimoire.losses.sft:SFTLoss",
    "dpo": "grimoire.losses.dpo:DPOLoss",
    "ipo": "grimoire.losses.ipo:IPOLoss",
    "simpo": "grimoire.losses.simpo:SimPOLoss",
    "cpo": "grimoire.losses.cpo:CPOLoss",
    "orpo": "grimoire.losses.orpo:ORPOLoss",
    "kto": "grimoire.losses.kto:KTOLoss",
    "reward": "grimoire.losses.reward:RewardModelLoss",
    "grpo": "grimoire.losses.grpo:GRPOMethod",
    "rloo": "grimoire.losses.rloo:RLOOMethod",
    "online_dpo": "grimoire.losses.online_dpo:OnlineDPOMethod",
    "raft": "grimoire.losses.raft:RAFTMethod",
    "distill": "grimoire.losses.distill:DistillMethod",
}

#: ``dataset.tokenize.type`` -> row-level tokenize function ``fn(example, tokenizer, max_length,
#: **kwargs) -> dict`` raising ``DataError`` on a bad row.
TOKENIZERS: dict[str, str] = {
    "sft": "grimoire.rows.sft:tokenize_sft",
    "pretokenized": "grimoire.rows.pretokenized:tokenize_pretokenized",
    "pretrain": "grimoire.rows.pretokenized:pretrain_blocks",
    "preference": "grimoire.rows.preference:tokenize_preference",
    "kto": "grimoire.rows.kto:tokenize_kto",
    "grpo": "grimoire.rows.prompts:tokenize_grpo",
}
# Pair-based losses read the same preference columns; with these aliases a config may omit
# ``dataset.tokenize.type`` (it defaults to the loss's name).
for _pair_loss in ("dpo", "ipo", "simpo", "cpo", "orpo", "reward"):
    TOKENIZERS[_pair_loss] = TOKENIZERS["preference"]
# Prompt-only data, like GRPO; "prompt" is grimoire-rl's name for it.
for _online in ("rloo", "online_dpo", "raft", "distill", "prompt"):
    TOKENIZERS[_online] = TOKENIZERS["grpo"]

#: ``loss.args.engine`` (a name, or the ``type`` of ``{type, args}``) -> rollout engine class;
#: see :mod:`grimoire.rollout.engines.backends`. Engines take short names only, not specs.
ENGINES: dict[str, str] = {
    "hf": "grimoire.rollout.engines.hf:HFGenerateEngine",
    "vllm": "grimoire.rollout.engines.vllm_engine:VLLMEngine",
    "vllm-server": "grimoire.rollout.engines.vllm_server:VLLMServerEngine",
}

#: A rollout's ``tool_call_parser`` -> ``text -> ParsedTurn`` (see grimoire.rollout.agents.tool_parsers).
TOOL_CALL_PARSERS: dict[str, str] = {
    "hermes": "grimoire.rollout.agents.tool_parsers:parse_hermes",
    "qwen": "grimoire.rollout.agents.tool_parsers:parse_hermes",
    "llama3_json": "grimoire.rollout.agents.tool_parsers:parse_llama3_json",
    "qwen3_coder": "grimoire.rollout.agents.tool_parsers:parse_qwen3_coder",
    "pythonic": "grimoire.rollout.agents.tool_parsers:parse_pythonic",
    "tiny": "grimoire.rollout.agents.tool_parsers:parse_tiny",
}

#: ``loss.args.reward_funcs`` short names -> a reward function, or a class instantiated with the
#: entry's ``args`` (``{type: answer_match, args: {extract: boxed}}``); see
#: :mod:`grimoire.rollout.rewards.calls`.
REWARD_FUNCS: dict[str, str] = {
    "exact_match": "grimoire.rollout.rewards.scoring:exact_match_reward",
    "char_match": "grimoire.rollout.rewards.scoring:char_match_reward",
    "answer_match": "grimoire.rollout.rewards.answers:AnswerMatch",
    "think_format": "grimoire.rollout.rewards.shaping:ThinkFormat",
    "overlong_penalty": "grimoire.rollout.rewards.shaping:OverlongPenalty",
    "reward_model": "grimoire.rollout.rewards.reward_model:RewardModelReward",
    "llm_judge": "grimoire.rollout.rewards.judge:LLMJudge",
}

#: ``callbacks[i].type`` -> callback class (instantiated with ``callbacks[i].args``).
CALLBACKS: dict[str, str] = {
    "exact_match": "grimoire.training.heldout:ExactMatchCallback",
    "text_nll": "grimoire.training.heldout:TextNLLCallback",
}


#: Module paths a config's ``package.module:Name`` spec may still give for a built-in that lives
#: elsewhere now (the built-in tool, rewards and tool-call parsers, from before ``rollout/`` held
#: them in ``agents/`` and ``rewards/``): :func:`import_spec` reads the new path, so such a YAML
#: file keeps working.
MOVED_MODULES: dict[str, str] = {
    "grimoire.rollout.calculator": "grimoire.rollout.agents.calculator",
    "grimoire.rollout.tool_calls": "grimoire.rollout.agents.tool_parsers",
    "grimoire.rollout.reward_answers": "grimoire.rollout.rewards.answers",
    "grimoire.rollout.reward_shaping": "grimoire.rollout.rewards.shaping",
    "grimoire.rollout.reward_model": "grimoire.rollout.rewards.reward_model",
}


def is_spec(name: str) -> bool:
    """True when ``name`` looks like a ``package.module:Name`` import spec (not a short name)."""
    return ":" in name


def import_spec(spec: str) -> Any:
    """Import ``"package.module:Name"`` and return the named attribute.

    Raises ``ImportError`` / ``AttributeError`` / ``ValueError`` unchanged; :func:`resolve`
    turns them into a :class:`ConfigError` that names the spec.
    """
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"{spec!r} is not of the form 'package.module:Name'")
    obj: Any = importlib.import_module(MOVED_MODULES.get(module_name, module_name))
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def resolve(name_or_spec: str, registry: Mapping[str, str], kind: str) -> Any:
    """The object a short name or ``package.module:Name`` spec refers to.

    ``kind`` names what is being resolved in error messages (e.g. ``"loss.type"``). Unknown short
    names raise a :class:`ConfigError` with a did-you-mean hint and the known names; a spec whose
    import fails raises a :class:`ConfigError` naming the spec and the underlying error.
    Note that resolving a spec imports (and so executes) the named module.
    """
    if not isinstance(name_or_spec, str) or not name_or_spec:
        raise ConfigError(
            [f"{kind}: expected a registered name or 'package.module:Name', got {name_or_spec!r}"]
        )
    if is_spec(name_or_spec):
        spec = name_or_spec
    elif name_or_spec in registry:
        spec = registry[name_or_spec]
    else:
        known = ", ".join(sorted(registry)) or "(none registered)"
        raise ConfigError(
            [
                f"{kind}: unknown name {name_or_spec!r}{did_you_mean(name_or_spec, registry)}; "
                f"known: {known} (or give an import spec 'package.module:Name')"
            ]
        )
    try:
        return import_spec(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        via = f" (registered as {name_or_spec!r})" if spec != name_or_spec else ""
        raise ConfigError(
            [f"{kind}: cannot import {spec!r}{via}: {type(exc).__name__}: {exc}"]
        ) from exc


__all__ = [
    "CALLBACKS",
    "ENGINES",
    "LOSSES",
    "MOVED_MODULES",
    "REWARD_FUNCS",
    "TOKENIZERS",
    "TOOL_CALL_PARSERS",
    "import_spec",
    "is_spec",
    "resolve",
]
