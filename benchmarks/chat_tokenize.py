"""Tokenizing speed of multi-turn chat rows: this checkout against a baseline source tree.

    python benchmarks/chat_tokenize.py [--rows 10000] [--baseline-src /work/main/src]

Each measurement runs ``tokenize_sft`` over the same ``--rows`` conversations (system + three
user/assistant turns, distinct random words) in a fresh subprocess whose ``PYTHONPATH`` starts
with one source tree: the baseline's (e.g. main's, which renders the conversation once per turn
boundary and diffs prefixes) and this checkout's (one rendering, spans located in it). Both run
in the same invocation on the same machine, alternating, best of ``--repeats``. Templates: the
tiny tokenizer's own, and TRL's Qwen2.5 template (prefix-stable, so the baseline accepts it)
when ``trl`` is installed. Prints rows/s and the ratio this/baseline per template.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(6)}]
        for _ in range(3):
            messages += [
                {"role": "user", "content": text(rng.randint(5, 20))},
                {"role": "assistant", "content": text(rng.randint(10, 40))},
            ]
        rows.append({"messages": messages})
    return rows


def worker(template: str, rows: int) -> None:
    """Tokenize ``rows`` conversations with the source tree first on sys.path; print rows/s."""
    import re
    from pathlib import Path

    from grimoire.data import tokenize_sft
    from grimoire.model.tiny import build_tokenizer

    tok = build_tokenizer()
    if template != "tiny":
        import trl

        path = Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja"
        tok.chat_template = path.read_text()
        specials = sorted(set(re.findall(r"<\|[a-z_]+\|>", tok.chat_template)))
        tok.add_special_tokens({"additional_special_tokens": specials})
    data = conversations(rows)
    tokenize_sft(data[0], tok, max_length=100_000)  # warm-up: the template compiles once
    start = time.perf_counter()
    for row in data:
        tokenize_sft(row, tok, max_length=100_000)
    elapsed = time.perf_counter() - start
    print(json.dumps({"rows_per_s": rows / elapsed}))


def measure(src: str, template: str, rows: int) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(bench.ROOT)]))
    cmd = [sys.executable, __file__, "--worker", template, "--rows", str(rows)]
    out = bench.run_or_exit(cmd, f"{template} on {src}", env)
    return bench.last_json(out.stdout)["rows_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline-src", default="/work/main/src")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rows)
        return
    templates = ["tiny"]
    if subprocess.run([sys.executable, "-c", "import trl"], capture_output=True).returncode == 0:
        templates.append("qwen2_5")
    print(bench.machine_line())
    print(f"# {args.rows} rows of system + 3 user/assistant turns; best of {args.repeats}")
    print("template  baseline rows/s  this rows/s  this/baseline")
    for template in templates:
        best = {"baseline": 0.0, "this": 0.0}
        for _ in range(args.repeats):
            for name, src in (("baseline", args.baseline_src), ("this", str(bench.ROOT / "src"))):
                best[name] = max(best[name], measure(src, template, args.rows))
        ratio = best["this"] / best["baseline"]
        print(f"{template:8s}  {best['baseline']:15.0f}  {best['this']:11.0f}  {ratio:13.2f}")


if __name__ == "__main__":
    main()
