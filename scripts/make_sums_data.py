"""Write the two-digit sums data of the real-model recipes (docs/real-model.md) into assets/.

Deterministic (seed 0): ``sums_train.jsonl`` (chat rows: the question, the bare sum as the
assistant's answer), ``sums_prompts.jsonl`` (the same questions as prompts + ``answer``, for the
online methods) and ``sums_eval.jsonl`` (held-out questions, every shape: pairs that appear in neither).

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
        # Every shape in one row: ``messages`` for the SFT eval loss, ``prompt`` + ``answer`` for
        # the exact-match callback and the online methods, ``chosen`` / ``rejected`` (below) for
        # the preference methods' eval loss.
        "sums_eval.jsonl": [
            {
                "messages": [*question(a, b), {"role": "assistant", "content": str(a + b)}],
                "prompt": question(a, b),
                "answer": str(a + b),
            }
            for a, b in held_out
        ],
    }
    # DPO (examples/smollm2_dpo_concise.yaml): both answers right, the chosen one in the asked
    # form, the rejected one in the base model's own wordy styles (seen in its greedy answers).
    wordy = (
        "To solve this, we need to add {a} and {b}.\n\nThe answer is {s}.",
        "{a} + {b} = {s}",
        "To solve this problem, we need to combine {a} and {b}. Adding them gives {s}.",
        "The sum of {a} and {b} is {s}.",
    )

    def pair(i: int, a: int, b: int) -> dict[str, list[dict[str, str]]]:
        rejected = wordy[i % len(wordy)].format(a=a, b=b, s=a + b)
        return {
            "chosen": [{"role": "assistant", "content": str(a + b)}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }

    rows["sums_dpo.jsonl"] = [
        {"prompt": question(a, b), **pair(i, a, b)} for i, (a, b) in enumerate(train)
    ]
    for i, (row, (a, b)) in enumerate(zip(rows["sums_eval.jsonl"], held_out)):
        row.update(pair(i, a, b))  # the eval loss of the preference recipes
    for name, data in rows.items():
        with open(ASSETS / name, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in data)
        print(f"{name}: {len(data)} rows")


if __name__ == "__main__":
    main()
