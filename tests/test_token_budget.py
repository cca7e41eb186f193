"""``max_tokens_per_device`` holds for every method family, seen from the model's side.

The probe script (tests/scripts/budget_probe.py) trains each family under a small budget with a
hook on every model's decoder: the largest pass (training, reference, old-policy, scoring,
generation with its KV cache) must fit the budget, and the samples that received gradient over
the epoch must be exactly the data's units, each as often as the method trains it (rank-sync
dummy passes run with loss weight 0 and get no gradient, so they do not count). With two
processes (DDP, and FSDP2 with its sharded policy and reference) the ranks' trained samples
together must cover the data exactly once.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from tests.helpers.train_utils import free_port
from tests.scripts import budget_probe
from tests.test_distributed import LAUNCH, _env

FAMILIES = list(budget_probe.FAMILIES)
SCRIPT = Path(budget_probe.__file__)


def _match(sample: tuple[int, ...], units: dict[tuple[int, ...], int]) -> tuple[int, ...]:
    """The unit ``sample`` is (a cut sample is a prefix of it; an online sample extends its
    prompt with a completion). Units have distinct first tokens, so at most one can match."""
    found = [u for u in units if sample[: len(u)] == u or u[: len(sample)] == sample]
    assert len(found) == 1, f"sample {sample[:8]}... matches {len(found)} units"
    return found[0]


def _check(family: str, results: list[dict]) -> None:
    budget = results[0]["budget"]
    passes = [p for r in results for p in r["passes"]]
    largest = max(p["tokens"] for p in passes)
    assert largest <= budget, f"{family}: a pass of {largest} tokens > budget {budget}"
    assert {p["tag"] for p in passes} >= {"policy"}
    units = budget_probe.expected_units(family)
    trained = Counter(_match(tuple(s), units) for p in passes if p["grad"] for s in p["trained"])
    missing = {u[:4]: n - trained[u] for u, n in units.items() if trained[u] != n}
    assert not missing, f"{family}: units not trained exactly as often as expected: {missing}"


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("budget-1")
    budget_probe.run(str(tiny_dir), str(out), FAMILIES).close()
    return out


@pytest.fixture(scope="module")
def launched(tiny_dir, tmp_path_factory) -> Path:
    """One 2-process launch: every family under DDP, then under FSDP2 (``<out>/<mode>/``)."""
    out = tmp_path_factory.mktemp("budget-2")
    cmd = [*LAUNCH, "--main_process_port", str(free_port()), str(SCRIPT), str(tiny_dir)]
    env = {**_env(), "PROBE_DISTRIBUTED": "ddp,fsdp2"}
    subprocess.run([*cmd, str(out), ",".join(FAMILIES)], check=True, env=env, timeout=600)
    return out


@pytest.fixture(params=["ddp", "fsdp2"])
def two_processes(request, launched) -> Path:
    return launched / request.param


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_holds_one_process(one_process, family):
    _check(family, [json.loads((one_process / f"{family}.rank0.json").read_text())])


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_holds_two_processes(two_processes, family):
    results = [json.loads((two_processes / f"{family}.rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["steps"] == results[1]["steps"]
    _check(family, results)
