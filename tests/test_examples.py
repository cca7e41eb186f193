"""Every file in ``examples/`` runs as written from the repository root (issue #28, item 5).

Each example's documented command runs as a real subprocess in an empty folder holding only a
copy of ``examples/`` (the repository root as a newcomer sees it, so relative paths such as
``./output/...`` resolve the same way and nothing is written into the checkout). Where the
documented run takes minutes, the test appends overrides that only shorten it (``--set
training.max_steps=...``, fewer held-out rows, the script's own step flags); the rest of the
command is the documented one. :data:`RUNS` lists every example with its command, and :func:`test_every_example_is_run`
fails for a file added to ``examples/`` without one, so no example can silently stop running.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from tests.helpers.commands import ROOT, grimoire_command, run
from tests.helpers.train_utils import free_port

EXAMPLES = ROOT / "examples"
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
GRIMOIRE = "<grimoire>"  # replaced by the installed console script
PYTHON = "<python>"

#: Held-out rows the real-model examples score in the test (they score 100 to 300 as written).
HELD_OUT = 8


def fewer_held_out_rows(example: str) -> list[str]:
    """Overrides that score ``HELD_OUT`` rows of the evaluation set and of each callback's own
    rows (generation on all of them was most of an example's minute). ``--set`` cannot reach
    into a list, so the example's own ``callbacks`` list is given whole with only ``max_samples``
    added to each one's rows."""
    out = ["--set", f"eval_dataset.max_samples={HELD_OUT}"]
    callbacks = yaml.safe_load((EXAMPLES / example).read_text(encoding="utf-8")).get("callbacks")
    for spec in callbacks or []:
        spec["args"]["rows"]["dataset"]["max_samples"] = HELD_OUT
    return out + (["--set", f"callbacks={json.dumps(callbacks)}"] if callbacks else [])


#: example -> (documented command, overrides that only shorten it for the test, what it writes)
RUNS: dict[str, tuple[list[str], list[str], str]] = {
    "quickstart.yaml": (
        [GRIMOIRE, "train", "--config", "examples/quickstart.yaml"],
        # 1000 steps as written (tests/test_quickstart.py runs all of them and checks it learns).
        ["--set", "training.max_steps=20", "--set", "training.eval_steps=null"],
        "output/quickstart/final/model.safetensors",
    ),
    "chat_sft.yaml": (
        # 300 steps as written; multi-turn chat rows through the tiny tokenizer's chat template.
        [GRIMOIRE, "train", "--config", "examples/chat_sft.yaml"],
        ["--set", "training.max_steps=5"],
        "output/chat_sft/final/model.safetensors",
    ),
    "grpo_toy.yaml": (
        # Runs on its own: it starts from the bundled grimoire://assets/reverse_warm.
        [GRIMOIRE, "train", "--config", "examples/grpo_toy.yaml"],
        ["--set", "training.max_steps=4", "--set", "eval_dataset.max_samples=8"],
        "output/grpo_toy/final/model.safetensors",
    ),
    "agentic_lookup.yaml": (
        # Runs on its own: GRPO with the lookup tool from the bundled lookup_warm.
        [GRIMOIRE, "train", "--config", "examples/agentic_lookup.yaml"],
        ["--set", "training.max_steps=2", "--set", "training.eval_steps=2"]
        + ["--set", "eval_dataset.max_samples=4"],
        "output/agentic_lookup/final/model.safetensors",
    ),
    "trl_environment_factory.yaml": (
        # Runs on its own: a TRL environment_factory class (trl_lookup_env.py) as is.
        [GRIMOIRE, "train", "--config", "examples/trl_environment_factory.yaml"],
        ["--set", "training.max_steps=2", "--set", "training.eval_steps=2"]
        + ["--set", "eval_dataset.max_samples=4"],
        "output/trl_environment_factory/final/model.safetensors",
    ),
    "openenv_reverse.yaml": (
        # Its server (openenv_reverse_env.py) is started by the test as the header starts it,
        # on a port the OS picks; the override names that port.
        [GRIMOIRE, "train", "--config", "examples/openenv_reverse.yaml"],
        ["--set", "training.max_steps=2", "--set", "training.eval_steps=2"]
        + ["--set", "eval_dataset.max_samples=4"],
        "output/openenv_reverse/final/model.safetensors",
    ),
    "verifiers_environment.yaml": (
        # Runs on its own: a verifiers ToolEnv from load_environment() (verifiers_lookup_env.py).
        [GRIMOIRE, "train", "--config", "examples/verifiers_environment.yaml"],
        ["--set", "training.max_steps=2", "--set", "training.eval_steps=2"]
        + ["--set", "eval_dataset.max_samples=4"],
        "output/verifiers_environment/final/model.safetensors",
    ),
    "mcp_tools.yaml": (
        # Runs on its own: the lookup tool served by mcp_lookup_server.py over MCP (stdio).
        [GRIMOIRE, "train", "--config", "examples/mcp_tools.yaml"],
        ["--set", "training.max_steps=2", "--set", "training.eval_steps=2"]
        + ["--set", "eval_dataset.max_samples=4"],
        "output/mcp_tools/final/model.safetensors",
    ),
    "distill_toy.yaml": (
        # Runs on its own: a tiny:llama student, the bundled reverse_warm teacher.
        [GRIMOIRE, "train", "--config", "examples/distill_toy.yaml"],
        ["--set", "training.max_steps=4", "--set", "training.logging_steps=2"]
        + ["--set", "eval_dataset.max_samples=8"],
        "output/distill_toy/final/model.safetensors",
    ),
    "grimoire_rl_schema.yaml": (
        # Its header's command; `--set quantization=null` only where bitsandbytes is missing.
        [GRIMOIRE, "train", "--config", "examples/grimoire_rl_schema.yaml"]
        + ([] if HAS_BNB else ["--set", "quantization=null"]),
        [],
        "output/grimoire_rl_schema/final/adapter_config.json",
    ),
    "smollm2_sft_sums.yaml": (
        # The real model (SmolLM2-135M-Instruct from its wheel's GGUF file, converted once into
        # GRIMOIRE_CACHE: the session's, see test_example_runs_as_written); 30 steps as
        # written, docs/real-model.md has the measured run.
        [GRIMOIRE, "train", "--config", "examples/smollm2_sft_sums.yaml"],
        ["--set", "training.max_steps=1", "--set", "training.eval_on_start=false"]
        + ["--set", "training.eval_steps=null"]
        + fewer_held_out_rows("smollm2_sft_sums.yaml"),
        "output/smollm2_sft_sums/final/model.safetensors",
    ),
    "smollm2_dpo_concise.yaml": (
        [GRIMOIRE, "train", "--config", "examples/smollm2_dpo_concise.yaml"],
        ["--set", "training.max_steps=1", "--set", "training.eval_on_start=false"]
        + ["--set", "training.eval_steps=null", "--set", "dataset.max_samples=8"]
        + fewer_held_out_rows("smollm2_dpo_concise.yaml"),
        "output/smollm2_dpo_concise/final/model.safetensors",
    ),
    "smollm2_grpo_sums.yaml": (
        [GRIMOIRE, "train", "--config", "examples/smollm2_grpo_sums.yaml"],
        ["--set", "training.max_steps=1", "--set", "training.eval_on_start=false"]
        + ["--set", "training.eval_steps=null", "--set", "loss.args.max_new_tokens=8"]
        + ["--set", "training.batch_size=2", "--set", "loss.args.num_generations=2"]
        + fewer_held_out_rows("smollm2_grpo_sums.yaml"),
        "output/smollm2_grpo_sums/final/model.safetensors",
    ),
    "smollm2_grpo_calculator.yaml": (
        [GRIMOIRE, "train", "--config", "examples/smollm2_grpo_calculator.yaml"],
        ["--set", "training.max_steps=1", "--set", "training.eval_on_start=false"]
        + ["--set", "training.eval_steps=null", "--set", "loss.args.max_new_tokens=8"]
        + ["--set", "training.batch_size=2", "--set", "loss.args.num_generations=2"]
        + fewer_held_out_rows("smollm2_grpo_calculator.yaml"),
        "output/smollm2_grpo_calculator/final/model.safetensors",
    ),
    "smollm2_distill_sums.yaml": (
        # Its teacher is the SFT recipe's output; here the base model stands in for it (the
        # override names the same model), so the example runs without the SFT run first.
        [GRIMOIRE, "train", "--config", "examples/smollm2_distill_sums.yaml"],
        ["--set", "loss.args.teacher=grimoire://models/smollm2-135m-instruct"]
        + ["--set", "training.max_steps=1", "--set", "training.eval_on_start=false"]
        + ["--set", "training.eval_steps=null", "--set", "loss.args.max_new_tokens=8"]
        + ["--set", "training.batch_size=2", "--set", "loss.args.num_generations=2"]
        + fewer_held_out_rows("smollm2_distill_sums.yaml"),
        "output/smollm2_distill_sums/final/model.safetensors",
    ),
    "smollm2_continual_sums.yaml": (
        # The full fine-tune of the three (its header has the OSFT and LoRA commands).
        [GRIMOIRE, "train", "--config", "examples/smollm2_continual_sums.yaml"],
        ["--set", "training.max_steps=1", "--set", "training.eval_on_start=false"]
        + ["--set", "training.eval_steps=null"]
        + fewer_held_out_rows("smollm2_continual_sums.yaml"),
        "output/continual_full/metrics.jsonl",
    ),
    "sft_python.py": (
        [PYTHON, "examples/sft_python.py"],  # 300 steps of the tiny model as written
        ["--max-steps", "20"],
        "output/sft-example/final/model.safetensors",
    ),
    "grpo_toy.py": (
        [PYTHON, "examples/grpo_toy.py", "--out", "output/grpo_toy_py"],
        ["--sft-steps", "10", "--rl-steps", "2", "--num-generations", "4", "--heldout", "8"],
        "output/grpo_toy_py/grpo/metrics.jsonl",
    ),
    "accelerate/ddp.yaml": (
        # Its header's command with --num_processes (as it says to) and a CPU-sized run.yaml.
        ["accelerate", "launch", "--config_file", "examples/accelerate/ddp.yaml"]
        + ["--num_processes", "2", "-m", "grimoire.train", "--config", "run.yaml"],
        [],
        "output/ddp/metrics.jsonl",
    ),
}
#: Files no test here runs, and why (each is still checked by the named test).
NOT_RUN_HERE = {
    "accelerate/deepspeed_zero2.yaml": "DeepSpeed launches: tests/test_docs.py loads them "
    "with accelerate's reader and validates the launch arguments",
    "accelerate/deepspeed_zero3.yaml": "as above",
    "accelerate/ds_zero3.json": "read through deepspeed_zero3.yaml by tests/test_docs.py",
    "trl_lookup_env.py": "the class trl_environment_factory.yaml names, run with it",
    "openenv_reverse_env.py": "the server openenv_reverse.yaml trains against, run with it",
    "verifiers_lookup_env.py": "the load_environment() verifiers_environment.yaml names, run "
    "with it",
    "mcp_lookup_server.py": "the MCP server mcp_tools.yaml starts, run with it",
}
RUN_YAML = """\
# ddp.yaml's `run.yaml`: two CPU processes, a few steps of the tiny model.
model: {pretrained: "tiny:llama"}
dataset: {jsonl: grimoire://assets/reverse_eval.jsonl, max_samples: 32}
training: {output_dir: output/ddp, max_steps: 2, batch_size: 4, mixed_precision: "no",
           progress_bar: false}
save_to: false
"""


def test_every_example_is_run():
    files = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*") if p.is_file()}
    files = {f for f in files if "__pycache__" not in f}
    assert files == set(RUNS) | set(NOT_RUN_HERE), (
        "every file in examples/ needs its command in tests/test_examples.py::RUNS"
    )


def repo_root_copy(tmp_path: Path) -> Path:
    """An empty folder with a copy of examples/: the repository root, as far as they can tell."""
    root = tmp_path / "repo"
    shutil.copytree(EXAMPLES, root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def command(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
        out += grimoire_command() if a == GRIMOIRE else [sys.executable] if a == PYTHON else [a]
    if out[:2] == ["accelerate", "launch"]:  # this Python's accelerate, on a free port
        out = [sys.executable, "-m", "accelerate.commands.launch", *out[2:]]
        out[3:3] = ["--main_process_port", str(free_port())]
    return out


def run_against_openenv_server(argv: list[str], root: Path):
    """``argv`` run while the example's OpenEnv server runs (on a port the OS picks, named by
    an override); the run and the server's log."""
    from tests.helpers.openenv_server import serving

    with serving("openenv_reverse_env:app", cwd=root, app_dir="examples") as (server,):
        url = ["--set", f"loss.args.openenv.base_url={server.url}"]
        done = run(command(argv + url), root, timeout=900)
    return done, server.log


@pytest.mark.parametrize("example", sorted(RUNS))
def test_example_runs_as_written(example, tmp_path, request):
    documented, shorter, writes = RUNS[example]
    root = repo_root_copy(tmp_path)
    if example == "accelerate/ddp.yaml":
        (root / "run.yaml").write_text(RUN_YAML)
    # Two processes on a shared CPU: one thread each, as tests/test_distributed.py does.
    env = {"OMP_NUM_THREADS": "1"} if example == "accelerate/ddp.yaml" else {}
    if example.startswith("smollm2_"):  # the session's converted GGUF file, not a second one
        env["GRIMOIRE_CACHE"] = str(request.getfixturevalue("real_model_cache")[0])
    if example == "openenv_reverse.yaml":
        done, server_log = run_against_openenv_server(documented + shorter, root)
    else:
        done = run(command(documented + shorter), root, timeout=900, **env)
    assert (root / writes).is_file(), done.stdout[-2000:]
    if example == "accelerate/ddp.yaml":
        # Two processes: 32 rows / (4 per process x 2) = 4 steps per epoch, so step 2 is 0.5.
        records = [json.loads(x) for x in (root / writes).read_text().splitlines()]
        assert records[-1]["step"] == 2 and records[-1]["epoch"] == 0.5
    if example == "grpo_toy.yaml":
        assert "rewards/char_match_reward/mean" in done.stdout
    if example == "agentic_lookup.yaml":  # episodes played with the tool, also for evaluation
        records = [json.loads(x) for x in (root / "output/agentic_lookup/metrics.jsonl").open()]
        assert any(r.get("tools/calls", 0) > 0 for r in records), records
        assert any("eval/rewards/exact_match_reward/mean" in r for r in records), records
    if example == "trl_environment_factory.yaml":  # the class's tool was called, its reward in
        out = root / "output/trl_environment_factory/metrics.jsonl"
        records = [json.loads(x) for x in out.open()]
        assert any(r.get("tools/calls", 0) > 0 for r in records), records
        assert any(r.get("episode/reward_mean", 0) > 0 for r in records), records
    if example == "openenv_reverse.yaml":  # the server was stepped; its rewards are in
        records = [json.loads(x) for x in (root / "output/openenv_reverse/metrics.jsonl").open()]
        assert any(r.get("openenv/steps", 0) > 0 for r in records), records
        assert any(r.get("episode/reward_mean", 0) > 0 for r in records), records
        assert sum('"WebSocket /ws" [accepted]' in line for line in server_log) >= 32
    if example == "verifiers_environment.yaml":  # the rubric scored: its weighted sum is the
        # reward (1 x exact_answer + 0 x looked_up_the_word), its metrics logged beside it
        out = root / "output/verifiers_environment/metrics.jsonl"
        records = [r for r in map(json.loads, out.open()) if "rewards/verifiers/mean" in r]
        assert records and any(r["rewards/verifiers/lookup_calls/mean"] > 0 for r in records)
        for r in records:
            total, exact = r["rewards/verifiers/mean"], r["rewards/verifiers/exact_answer/mean"]
            assert total == pytest.approx(exact) and r["reward"] == pytest.approx(total), r
        assert any("eval/rewards/verifiers/mean" in r for r in map(json.loads, out.open()))
    if example == "mcp_tools.yaml":  # the calls reached the server and were answered
        records = [json.loads(x) for x in (root / "output/mcp_tools/metrics.jsonl").open()]
        assert sum(r.get("tools/ok", 0) for r in records) > 0, records
        assert not any(r.get("tools/exception", 0) for r in records), records
    if example == "distill_toy.yaml":
        records = [json.loads(x) for x in (root / "output/distill_toy/metrics.jsonl").open()]
        assert any("distill/reverse_kl" in r for r in records)
