"""GRPO rollout throughput: generated tokens/s and where a step's time goes.

Timers wrap methods on the live instances (nothing in ``grimoire.rollout`` is edited): the
engine's ``_sample`` (generation: ``model.generate``), its ``score`` (old-policy log-probs), the
method's ``reference_logps`` (reference scoring), the stage's ``step`` (the whole rollout) and
the trainer's ``_optimizer_step`` (the whole step; training = step - rollout). It also records,
per ``model.generate`` call, whether the KV cache was on (``use_cache``) and how many prompt
groups the call held, to check that the G completions of a prompt are sampled together.

    python benchmarks/rollout_throughput.py           # full table
    python benchmarks/rollout_throughput.py --tiny    # seconds: table shape only

``--engines``: rollout tokens/s of the sampling backends alone (``engine.generate`` without old
log-probs, every completion ``max_new_tokens`` long: no EOS), at a mid-size model with prompts as
long as the completions: HF ``generate`` as it runs by itself (``hf``: each completion's copy of
its prompt prefilled, a ``DynamicCache`` concatenated at every step) against a static KV cache
(``hf-static``), one prefill per prompt (``hf-prefill``) and both (``hf-prefill-static``, the
engine's default). With one seed all sample the same tokens (checked here too).
Where ``vllm`` is importable a third row times :class:`~grimoire.rollout.engines.vllm_engine.VLLMEngine`
(colocated, its weights synced from the same model; its samples come from its own RNG, so they
are not compared), and a line gives the time of one weight sync of that model.

    python benchmarks/rollout_throughput.py --engines          # 64 prompts x 8 x 128 tokens
    python benchmarks/rollout_throughput.py --engines --mid    # the same model, 16 x 8 x 64
    python benchmarks/rollout_throughput.py --engines --tiny
    python benchmarks/rollout_throughput.py --engines --device cuda   # benchmarks/gpu_check.sh
"""

from __future__ import annotations

import argparse
import time
from typing import Any

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench

SIZES = {
    "full": dict(vocab=32_000, hidden=256, layers=4, prompts=16, batch=4, G=8, new=64, steps=4),
    "tiny": dict(vocab=64, hidden=32, layers=1, prompts=4, batch=2, G=2, new=4, steps=2),
}


#: ``--engines``: hidden 512, 8 layers, 64 prompts x G=8 x 128 new tokens, 128-token prompts.
#: Heads of 128 (full) and 32 (tiny): vLLM's CPU attention has no kernel below 32.
ENGINE_SIZES = {
    "full": dict(
        vocab=32_000, hidden=512, heads=4, layers=8, prompts=64, G=8, new=128, prompt_len=128
    ),
    # The full model on a quarter of the rollout (16 prompts x 8 x 64, 64-token prompts): what a
    # shared 2-core machine finishes (the full size did not within 50 minutes there).
    "mid": dict(
        vocab=32_000, hidden=512, heads=4, layers=8, prompts=16, G=8, new=64, prompt_len=64
    ),
    "tiny": dict(vocab=64, hidden=64, heads=2, layers=1, prompts=4, G=4, new=8, prompt_len=8),
}
ENGINES = {
    "hf": {"prefill_once": False, "static_cache": False},  # what `generate` does by itself
    "hf-static": {"prefill_once": False, "static_cache": True},
    "hf-prefill": {"prefill_once": True, "static_cache": False},
    "hf-prefill-static": {"prefill_once": True, "static_cache": True},  # the default
    "vllm": {},
}


def _engine(name: str, new: int) -> Any:
    from grimoire.rollout.engines.hf import HFGenerateEngine
    from grimoire.rollout.engines.vllm_engine import VLLMEngine

    if name == "vllm":  # sampler log-probs on, as in training (the correction needs them)
        return VLLMEngine(max_new_tokens=new)
    return HFGenerateEngine(max_new_tokens=new, **ENGINES[name])


def engines(size: str, repeats: int = 1, device: str = "cpu") -> list[dict[str, Any]]:
    """Each engine's best of ``repeats`` timed ``generate`` calls on the same prompts and seed
    (``vllm`` only where it is importable), plus one timed vLLM weight sync."""
    import random

    import torch

    from grimoire.rollout.engines.vllm_engine import vllm_available

    s = ENGINE_SIZES[size]
    positions = s["prompt_len"] + s["new"]
    model = bench.tiny_llama(s["vocab"], s["hidden"], s["layers"], positions, heads=s["heads"])
    model.to(device).eval()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(4, s["vocab"]) for _ in range(s["prompt_len"])] for _ in range(s["prompts"])
    ]
    rows, samples = [], {}
    names = [n for n in ENGINES if n != "vllm" or vllm_available()]
    for name in names:
        engine = _engine(name, s["new"])
        engine.bind(model, pad_token_id=0, eos_token_id=None)  # no EOS: full-length completions
        engine.generate(prompts[:2], 2, with_old_logps=False)  # warm-up (vLLM: the first sync)
        best = float("inf")
        for _ in range(repeats):
            torch.manual_seed(0)
            start = time.perf_counter()
            rollout = engine.generate(prompts, s["G"], with_old_logps=False)
            best = min(best, time.perf_counter() - start)
        samples[name] = rollout.completion_ids.tolist()
        tokens = int(rollout.completion_mask.sum())
        rows.append({"engine": name, "seconds": best, "tokens": tokens, "tok_s": tokens / best})
        if name == "vllm":
            with torch.no_grad():  # an in-place write, as an optimizer step: the next call syncs
                next(model.parameters()).add_(0.0)
            start = time.perf_counter()
            engine.sync_weights()
            rows[-1]["sync_s"] = time.perf_counter() - start
            engine.close()
    for r in rows:
        r["ratio"] = r["tok_s"] / rows[0]["tok_s"]
        r["same_samples"] = (
            "n/a (own RNG)" if r["engine"] == "vllm" else samples[r["engine"]] == samples["hf"]
        )
    return rows


def engines_table(rows: list[dict[str, Any]], size: str) -> list[str]:
    s = ENGINE_SIZES[size]
    lines = [
        bench.machine_line(),
        f"# rollout only: Llama vocab {s['vocab']}, hidden {s['hidden']} ({s['heads']} heads), "
        f"{s['layers']} layers, "
        f"fp32; {s['prompts']} prompts of {s['prompt_len']} tokens x G={s['G']} x "
        f"{s['new']} new tokens, one generate call; best of the repeats",
        "| engine | seconds | generated tokens | rollout tok/s | vs hf | same samples as hf |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['seconds']:.2f} | {r['tokens']} | {r['tok_s']:.0f} "
            f"| {r['ratio']:.2f}x | {r['same_samples']} |"
        )
    lines += [
        f"vllm: one weight sync of the whole model (policy -> vLLM, in process): "
        f"{r['sync_s']:.2f} s"
        for r in rows
        if "sync_s" in r
    ]
    if not any(r["engine"] == "vllm" for r in rows):
        lines.append("vllm: not installed here (pip install 'grimoire[vllm]'); no row")
    return lines


def _timed(obj: Any, name: str, totals: dict[str, float], key: str) -> None:
    """Replace ``obj.name`` by a wrapper adding its wall time to ``totals[key]``."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def run(size: str, out: str) -> dict[str, Any]:
    import torch

    from grimoire import GrimoireTrainer
    from grimoire.losses.grpo import GRPOMethod
    from grimoire.model.tiny import build_tokenizer, reverse_rows
    from grimoire.rows.prompts import tokenize_grpo

    s = SIZES[size]
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = bench.tiny_llama(max(s["vocab"], len(tok)), s["hidden"], s["layers"], 512)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(s["prompts"], seed=1)]
    method = GRPOMethod(
        ["char_match"],
        num_generations=s["G"],
        max_new_tokens=s["new"],
        beta=0.04,
        ref_model="copy",
        num_iterations=2,
    )
    config = bench.training_config(
        out, batch_size=s["batch"], max_steps=s["steps"], gradient_checkpointing=False
    )
    trainer = GrimoireTrainer(model, tok, config, method, rows)
    engine, stage = trainer.rollouts.engine, trainer.rollouts
    totals = dict.fromkeys(("generation", "old_policy", "reference", "rollout", "step"), 0.0)
    generated, calls = [0], []
    _timed(engine, "_sample", totals, "generation")
    _timed(engine, "score", totals, "old_policy")
    _timed(method, "reference_logps", totals, "reference")
    _timed(stage, "step", totals, "rollout")
    _timed(trainer, "_optimizer_step", totals, "step")
    policy = engine.model
    generate = policy.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        rows_ = [tuple(r[m.bool()].tolist()) for r, m in zip(ids, kwargs["attention_mask"])]
        # Rows of one prompt are adjacent and complete: G copies of each distinct prompt.
        groups = {r: rows_.count(r) for r in rows_}
        calls.append({"use_cache": bool(policy.config.use_cache), "groups": groups})
        result = generate(*args, **kwargs)
        generated[0] += int((result[:, ids.shape[1] :] != engine.pad_token_id).sum())
        return result

    policy.generate = spy
    trainer.train()
    train_s = totals["step"] - totals["rollout"]
    scoring = totals["old_policy"] + totals["reference"]
    return {
        "generated_tokens": generated[0],
        "gen_tok_s": generated[0] / max(totals["generation"], 1e-9),
        "generation_s": totals["generation"],
        "scoring_s": scoring,
        "old_policy_s": totals["old_policy"],
        "reference_s": totals["reference"],
        "other_rollout_s": totals["rollout"] - totals["generation"] - scoring,
        "train_s": train_s,
        "step_s": totals["step"],
        "kv_cache_on": all(c["use_cache"] for c in calls),
        "groups_whole": all(n == s["G"] for c in calls for n in c["groups"].values()),
        "generate_calls": len(calls),
    }


def table(r: dict[str, Any], size: str) -> list[str]:
    s = SIZES[size]
    step = max(r["step_s"], 1e-9)
    lines = [
        bench.machine_line(),
        f"# GRPO rollout, vocab {s['vocab']}, hidden {s['hidden']}, {s['layers']} layers, "
        f"{s['batch']} prompts x G={s['G']} per step, max_new_tokens {s['new']}, "
        f"{s['steps']} steps (num_iterations=2), fp32",
        "| part | seconds | share of steps |",
        "|---|---|---|",
    ]
    for name in ("generation", "old_policy", "reference", "other_rollout", "train"):
        lines.append(f"| {name} | {r[name + '_s']:.2f} | {r[name + '_s'] / step:.0%} |")
    lines += [
        f"generated {r['generated_tokens']} tokens at {r['gen_tok_s']:.0f} tok/s "
        f"({r['generate_calls']} generate calls)",
        f"KV cache on in every generate call: {r['kv_cache_on']}; every call holds all G "
        f"completions of each of its prompts: {r['groups_whole']}",
    ]
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--out", default="/tmp/rollout-throughput")
    parser.add_argument("--engines", action="store_true", help="compare the sampling backends")
    parser.add_argument("--repeats", type=int, default=1, help="--engines: timed calls each")
    parser.add_argument("--mid", action="store_true", help="--engines: a quarter of the rollout")
    parser.add_argument("--device", default="cpu", help="--engines: where the HF engines run")
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "mid" if args.mid and args.engines else "full"
    if args.engines:
        lines = engines_table(engines(size, args.repeats, args.device), size)
    else:
        lines = table(run(size, args.out), size)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
