"""Write the two-digit sums data of the real-model recipes (docs/real-model.md) into assets/.

Deterministic (seed 0): ``sums_train.jsonl`` (chat rows: the question, the bare sum as the
assistant's answer), ``sums_prompts.jsonl`` (the same questions as prompts + ``answer``, for the
online methods) and ``sums_eval.jsonl`` (held-out questions, both shapes: pairs that appear in neither).

    python scripts/make_sums_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "grimoire" / "assets"
QUESTION = "What is {a} + {b}? Answer with the number only."


def question(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTION.format(a=a, b=b)}]


def main() -> None:
    rng = random.Random(0)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], 600)
    held_out, train = pairs[:100], pairs[100:]
    rows = {
        "sums_train.jsonl": [
            {"messages": [*question(a, b), {"role": "assistant", "content": str(a + b)}]}
            for a, b in train
        ],
        "sums_prompts.jsonl": [{"prompt": question(a, b), "answer": str(a + b)} for a, b in train],
        # Both shapes in one row: ``messages`` for the SFT eval loss, ``prompt`` + ``answer`` for
        # the exact-match callback and the online methods.
        "sums_eval.jsonl": [
            {
                "messages": [*question(a, b), {"role": "assistant", "content": str(a + b)}],
                "prompt": question(a, b),
                "answer": str(a + b),
            }
            for a, b in held_out
        ],
    }
    for name, data in rows.items():
        with open(ASSETS / name, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in data)
        print(f"{name}: {len(data)} rows")


if __name__ == "__main__":
    main()
