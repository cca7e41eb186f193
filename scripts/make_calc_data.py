"""Write the calculator-tool data of the real-model recipes (docs/real-model.md) into assets/.

Deterministic (seed 0). Each row's ``prompt`` is a short conversation: a system message naming
the calculator, two worked exchanges (one small product answered at once, one product worked with the
calculator), then the question, a product of two two-digit numbers; ``answer`` is the
product. ``calc_prompts.jsonl`` has 400 training questions, ``calc_eval.jsonl`` 100 held-out
ones (pairs in neither the training set nor the worked examples).

The calculator call is written as SmolLM2's chat template has no tool syntax of its own: in
the ``pythonic`` form (``[calculator(expression="23 * 41")]``) that
``loss.args.tool_call_parser: pythonic`` reads, and the worked example shows it.

    python scripts/make_calc_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "grimoire" / "assets"
SYSTEM = (
    "You are a helpful assistant with a calculator. To use it, write the call alone, then "
    "answer with the number only."
)
QUESTION = "What is {a} * {b}?"
WORKED = (23, 41)


def prompt(a: int, b: int) -> list[dict[str, str]]:
    x, y = WORKED
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION.format(a=6, b=7)},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": QUESTION.format(a=x, b=y)},
        {"role": "assistant", "content": f'[calculator(expression="{x} * {y}")]'},
        {"role": "tool", "content": str(x * y)},
        {"role": "assistant", "content": str(x * y)},
        {"role": "user", "content": QUESTION.format(a=a, b=b)},
    ]


def main() -> None:
    rng = random.Random(0)
    pairs = [(a, b) for a in range(11, 100) for b in range(11, 100) if (a, b) != WORKED]
    chosen = rng.sample(pairs, 500)
    held_out, train = chosen[:100], chosen[100:]
    for name, rows in (("calc_prompts.jsonl", train), ("calc_eval.jsonl", held_out)):
        with open(ASSETS / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": prompt(a, b), "answer": str(a * b)}) + "\n")
        print(f"wrote {ASSETS / name} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
