"""A verifiers environment written the verifiers way, nothing of grimoire's in it.

``examples/verifiers_environment.yaml`` names it (``verifiers: verifiers_lookup_env:load_environment``;
the config's folder is on the import path). The same module is a verifiers environment package's
entry point: ``vf.load_environment("verifiers_lookup_env")`` loads it, and ``vf-eval`` evaluates it
against any OpenAI-compatible endpoint.

The task is grimoire's lookup task (``reverse abcdefg=`` -> ``gfedcba``) with its ``lookup`` tool:
a ``vf.ToolEnv`` whose rubric rewards the exact answer (weight 1) and logs whether the episode
looked up the prompt's own word (weight 0, a metric).
"""

from __future__ import annotations

import json
from pathlib import Path

import verifiers as vf
from datasets import Dataset

import grimoire

ASSETS = Path(grimoire.__file__).parent / "assets"


def lookup(word: str) -> str:
    """The reverse of a word.

    Args:
        word: the word to look up
    """
    return word[::-1]


def exact_answer(completion, answer, **kwargs) -> float:
    """1.0 when the last assistant message is the answer."""
    said = [m for m in completion if m.role == "assistant"]
    return float(bool(said) and (said[-1].content or "").strip() == answer)


def looked_up_the_word(completion, answer, **kwargs) -> float:
    """1.0 when a call asked for the prompt's own word (the reverse of the answer)."""
    calls = [c for m in completion if m.role == "assistant" for c in m.tool_calls or []]
    return float(any(json.loads(c.arguments).get("word") == answer[::-1] for c in calls))


def questions(name: str, n: int) -> Dataset:
    """The first ``n`` rows of a bundled JSONL file as verifiers' ``question`` / ``answer``."""
    lines = (ASSETS / name).read_text().splitlines()[:n]
    rows = [json.loads(line) for line in lines]
    return Dataset.from_list([{"question": r["prompt"], "answer": r["answer"]} for r in rows])


def load_environment(num_rows: int = 64, max_turns: int = 3) -> vf.Environment:
    rubric = vf.Rubric(funcs=[exact_answer, looked_up_the_word], weights=[1.0, 0.0])
    return vf.ToolEnv(
        dataset=questions("lookup_prompts.jsonl", num_rows),
        eval_dataset=questions("lookup_eval.jsonl", num_rows),
        tools=[lookup],
        rubric=rubric,
        max_turns=max_turns,
    )
