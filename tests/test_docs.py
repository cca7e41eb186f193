"""The documentation is tested: its Python runs, its configs validate, its tables are current.

What is checked
---------------
1. Every fenced ```python block in ``README.md`` and ``docs/*.md`` (every file there, including
   guides added later) is executed. Other fences (``bash``, ``yaml``, ``text``, ...) are shown to
   readers and never run.
2. Every Grimoire YAML config under ``examples/`` and ``src/grimoire/assets/`` passes the CLI's
   validation (``load_config`` + ``validate_config``, what ``grimoire validate`` runs), with the
   repository root as working directory. Files under ``examples/accelerate/`` are accelerate
   launcher configs instead: each must load with accelerate's own ``ClusterConfig`` reader, and a
   ``deepspeed_config_file`` it names must exist and be valid JSON.
3. Every ``TrainingConfig`` field appears in the table of ``docs/configuration.md`` with its type
   and its default, and the table lists no field that no longer exists.
4. ``examples/sft_python.py`` (the README's Python example as a script) runs.

How a doc file's Python blocks run (the contract for whoever writes docs)
--------------------------------------------------------------------------
- The blocks of one file run **in order, in one shared namespace**: a later block may use names
  an earlier one defined. Each file starts afresh.
- The namespace is **seeded** with inputs a reader would bring, so a block may use them without
  defining them (say in the prose what they are):

  ``model_path``     folder with a tiny random Llama + character tokenizer (``grimoire.model.tiny``)
  ``tokenizer``      ``AutoTokenizer.from_pretrained(model_path)``
  ``dataset``        a ``datasets.Dataset`` of 64 raw rows: ``prompt``, ``response``, ``answer``
                     (the string-reversal task of ``grimoire.model.tiny.reverse_rows``)
  ``eval_rows``      16 held-out raw rows (a list of dicts), e.g. for ``ExactMatchCallback``
  ``train_dataset``  ``dataset`` tokenized with ``tokenize_sft`` (``max_length=64``)
  ``eval_dataset``   ``eval_rows`` tokenized the same way

- **Placeholder lines**: a line that assigns a plain string literal to ``model_path`` (e.g.
  ``model_path = "path/to/your/model"``) is dropped before running, so examples can show a
  complete, copy-pasteable program while the test keeps the tiny model.
- The working directory is a fresh temporary folder holding ``train.jsonl`` (the 64 rows),
  ``eval.jsonl`` (the 16 rows) and ``run.yaml`` (a small valid CLI config on ``tiny:llama``), so
  relative paths such as ``output_dir="./output"`` land there.
- **Training is shortened, not rewritten**: docs show realistic settings (``num_epochs=3``,
  ``eval_steps=100``, ...); while the blocks run, every ``TrainingConfig`` built (in Python or by
  the CLI) has ``max_steps`` capped at ``MAX_DOC_STEPS``. The rest of the config is used as
  written, so the defaults (`auto` precision, activation checkpointing) are exercised too.
- A block preceded by ``<!-- skip-test: REASON -->`` (only blank lines in between) is not run;
  the reason is required and shown in pytest's skip summary. Keep skips rare: only for blocks
  that cannot run on a CPU-only machine with what is installed (e.g. a GPU or a hub download).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import runpy
import sys
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.is_file()]
CONFIG_TABLE = ROOT / "docs" / "configuration.md"
ACCELERATE_DIR = ROOT / "examples" / "accelerate"
MAX_DOC_STEPS = 3
N_TRAIN, N_EVAL = 64, 16

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})(?P<info>[^\n`]*)$")
SKIP = re.compile(r"<!--\s*skip-test:\s*(?P<reason>.*?)\s*-->")
PLACEHOLDER = re.compile(r"""^\s*model_path\s*=\s*(?:"[^"\n]*"|'[^'\n]*')\s*(?:#.*)?$""")

RUN_YAML = """\
# A small config for doc examples that read run.yaml (written by tests/test_docs.py).
model: {pretrained: "tiny:llama", model_kwargs: {dtype: float32}}
dataset: {jsonl: train.jsonl, tokenize: {type: sft}}
eval_dataset: {jsonl: eval.jsonl}
loss: {type: sft}
training:
  output_dir: ./output/run
  batch_size: 8
  max_length: 64
  learning_rate: 1e-3
  mixed_precision: "no"
  gradient_checkpointing: false
  save_on_epoch_end: false
  progress_bar: false
  logging_steps: 1
callbacks:
  - type: exact_match
    args: {max_new_tokens: 8}
save_to: ./output/run/final
"""


# --------------------------------------------------------------------------- markdown parsing


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip_reason: str | None


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a markdown file, with its language and skip marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, indent = m["ticks"], len(m["indent"])
        lang = (m["info"].strip().split() or [""])[0].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            close = FENCE.match(lines[j])
            same = close and close["ticks"][0] == ticks[0] and len(close["ticks"]) >= len(ticks)
            if same and not close["info"].strip():
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", _skip_reason(lines, i)))
        i = j + 1
    return blocks


def _skip_reason(lines: list[str], fence_index: int) -> str | None:
    k = fence_index - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0:
        return None
    m = SKIP.search(lines[k])
    if m is None:
        return None
    if not m["reason"]:
        raise AssertionError(f"line {k + 1}: <!-- skip-test: ... --> needs a reason")
    return m["reason"]


def python_blocks(path: Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.lang in ("python", "py", "python3")]


def without_placeholders(code: str) -> str:
    """Blank out ``model_path = "..."`` lines (keeping line numbers for tracebacks)."""
    return "\n".join("" if PLACEHOLDER.match(ln) else ln for ln in code.splitlines()) + "\n"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def doc_model(tmp_path_factory):
    from grimoire.model.tiny import save_tiny

    return str(save_tiny(tmp_path_factory.mktemp("doc-model"), arch="llama", seed=0))


@pytest.fixture
def doc_namespace(doc_model, tmp_path, monkeypatch):
    """The seeded namespace (see the module docstring), with cwd = a fresh temporary folder."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from grimoire.config.training import TrainingConfig
    from grimoire.data import tokenize_sft
    from grimoire.model.tiny import reverse_rows, write_jsonl

    train_rows, eval_rows = reverse_rows(N_TRAIN, seed=0), reverse_rows(N_EVAL, seed=1)
    write_jsonl(train_rows, tmp_path / "train.jsonl")
    write_jsonl(eval_rows, tmp_path / "eval.jsonl")
    (tmp_path / "run.yaml").write_text(RUN_YAML)
    monkeypatch.chdir(tmp_path)

    original = TrainingConfig.__post_init__

    def capped(self):
        original(self)
        self.max_steps = min(self.max_steps or MAX_DOC_STEPS, MAX_DOC_STEPS)

    monkeypatch.setattr(TrainingConfig, "__post_init__", capped)

    tokenizer = AutoTokenizer.from_pretrained(doc_model)
    dataset = Dataset.from_list(train_rows)

    def tok(rows):
        return Dataset.from_list([tokenize_sft(r, tokenizer, max_length=64) for r in rows])

    return {
        "__name__": "__doc__",
        "model_path": doc_model,
        "tokenizer": tokenizer,
        "dataset": dataset,
        "eval_rows": eval_rows,
        "train_dataset": tok(train_rows),
        "eval_dataset": tok(eval_rows),
    }


# --------------------------------------------------------------------------- 1. doc blocks


DOCS_WITH_PYTHON = [p for p in DOC_FILES if python_blocks(p)]


@pytest.mark.parametrize("doc", DOCS_WITH_PYTHON, ids=_rel)
def test_python_blocks_run(doc, doc_namespace, request, monkeypatch):
    ns = doc_namespace
    if doc.name == "real-model.md":  # the session's converted GGUF file, not one in ~/.cache
        monkeypatch.setenv("GRIMOIRE_CACHE", str(request.getfixturevalue("real_model_cache")[0]))
    skipped = []
    for block in python_blocks(doc):
        where = f"{_rel(doc)}:{block.line}"
        if block.skip_reason is not None:
            skipped.append(f"{where} ({block.skip_reason})")
            continue
        code = compile(without_placeholders(block.code), where, "exec")
        try:
            exec(code, ns)
        except BaseException as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"in the ```python block at {where}")
            raise
    if skipped and len(skipped) == len(python_blocks(doc)):
        pytest.skip("every block is marked skip-test: " + "; ".join(skipped))


def test_skip_markers_are_rare_and_explained():
    """Skips need a reason; a file may not skip most of its blocks (then it documents nothing)."""
    for doc in DOC_FILES:
        blocks = python_blocks(doc)  # raises on a marker without a reason
        skipped = [b for b in blocks if b.skip_reason is not None]
        assert len(skipped) <= max(1, len(blocks) // 2), (
            f"{_rel(doc)}: {len(skipped)} of {len(blocks)} python blocks are skipped"
        )


def test_block_parser_handles_markers_and_placeholders(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "text\n\n<!-- skip-test: needs a GPU -->\n\n```python\nimport torch\n```\n\n"
        "```bash\nls\n```\n\n```python\nmodel_path = 'x'  # yours\nprint(model_path)\n```\n"
    )
    blocks = fenced_blocks(md)
    assert [b.lang for b in blocks] == ["python", "bash", "python"]
    assert blocks[0].skip_reason == "needs a GPU" and blocks[2].skip_reason is None
    assert without_placeholders(blocks[2].code) == "\nprint(model_path)\n"


# --------------------------------------------------------------------------- 2. shipped configs


def _grimoire_yamls() -> list[Path]:
    found = [*sorted((ROOT / "src" / "grimoire" / "assets").glob("*.yaml"))]
    for ext in ("*.yaml", "*.yml"):
        found += [
            p for p in sorted((ROOT / "examples").rglob(ext)) if ACCELERATE_DIR not in p.parents
        ]
    return found


@pytest.mark.parametrize("path", _grimoire_yamls(), ids=_rel)
def test_shipped_grimoire_configs_validate(path, monkeypatch):
    from grimoire.cli.schema import load_config, validate_config

    monkeypatch.chdir(ROOT)
    problems = validate_config(load_config(path))
    # A config may start from the model another shipped config saves (grpo_toy.yaml from the
    # quickstart's save_to): validation rightly says that folder is missing until that one ran.
    saved = {load_config(other).get("save_to") for other in _grimoire_yamls() if other != path}
    problems = [
        p
        for p in problems
        if not any(p.startswith(f"model.pretrained: folder not found: {s} (") for s in saved if s)
    ]
    if importlib.util.find_spec("bitsandbytes") is None:
        # A config with a quantization: section is valid where bitsandbytes (CUDA) exists.
        problems = [p for p in problems if not p.startswith("quantization: needs bitsandbytes")]
    assert problems == [], f"{_rel(path)} does not validate:\n" + "\n".join(problems)


ACCELERATE_CONFIGS = sorted(ACCELERATE_DIR.glob("*.yaml"))


def test_accelerate_examples_exist():
    names = {p.name for p in ACCELERATE_CONFIGS}
    assert {"ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"} <= names
    assert "fsdp2.yaml" not in names  # FSDP2 is TrainingConfig.distributed, never a plugin


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=_rel)
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import ClusterConfig

    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw, dict) and raw.get("distributed_type"), path
    cfg = ClusterConfig.from_yaml_file(str(path))  # rejects unknown top-level keys
    assert cfg.num_machines >= 1
    ds = raw.get("deepspeed_config") or {}
    if "deepspeed_config_file" in ds:
        ds_file = ROOT / ds["deepspeed_config_file"]
        assert ds_file.is_file(), f"{_rel(path)} names a missing {ds_file}"
        data = json.loads(ds_file.read_text())
        # Grimoire builds the optimizer and scheduler itself and prepares no DataLoader.
        assert "optimizer" not in data and "scheduler" not in data
        assert isinstance(data["train_micro_batch_size_per_gpu"], int)


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=_rel)
def test_accelerate_launch_accepts_configs(path, monkeypatch):
    """``accelerate launch --config_file PATH`` argument validation (nothing is launched).

    For FSDP configs the plugin is also built from the environment the launcher would export,
    which checks the ``fsdp_config`` values themselves. (DeepSpeed's plugin needs deepspeed.)
    """
    launch = pytest.importorskip("accelerate.commands.launch")
    if not hasattr(launch, "_validate_launch_command"):
        pytest.skip("this accelerate version has no _validate_launch_command")
    monkeypatch.chdir(ROOT)
    args = launch.launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = launch._validate_launch_command(args)
    assert args.num_processes >= 1
    if args.use_fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.launch import prepare_multi_gpu_env

        for key, value in prepare_multi_gpu_env(args).items():
            monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2


# --------------------------------------------------------------------------- 3. the config table


def _table_rows(text: str) -> dict[str, list[str]]:
    """``{field: [type, default, description]}`` from rows shaped ``| `name` | ... |``."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())]
        cells = cells[1:-1] if len(cells) > 2 else cells
        if len(cells) >= 4 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _norm_type(text: str) -> str:
    return re.sub(r"\s+", "", text.strip("`")).replace("'", '"')


def test_configuration_table_matches_training_config():
    from grimoire.config.training import TrainingConfig

    rows = _table_rows(CONFIG_TABLE.read_text(encoding="utf-8"))
    hints = {f.name: f.type for f in dataclasses.fields(TrainingConfig)}
    problems = []
    for f in dataclasses.fields(TrainingConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        expected_row = f"| `{f.name}` | `{hints[f.name]}` | `{default!r}` | ... |"
        if f.name not in rows:
            problems.append(f"missing: {expected_row}")
            continue
        type_cell, default_cell = rows[f.name][0], rows[f.name][1]
        if _norm_type(type_cell) != _norm_type(str(hints[f.name])):
            problems.append(f"{f.name}: type {type_cell} != `{hints[f.name]}`")
        try:
            shown = ast.literal_eval(default_cell.strip("`"))
        except (ValueError, SyntaxError):
            problems.append(f"{f.name}: default cell {default_cell!r} is not a Python literal")
            continue
        if shown != default or type(shown) is not type(default):
            problems.append(f"{f.name}: default {default_cell} != `{default!r}`")
        if not rows[f.name][2]:
            problems.append(f"{f.name}: no description")
    stale = sorted(set(rows) - set(hints))
    problems += [f"not a TrainingConfig field any more: {name}" for name in stale]
    assert not problems, "docs/configuration.md is out of date:\n" + "\n".join(problems)


def test_config_type_hints_resolve():
    """The table shows annotations as written; they must still be real types."""
    from grimoire.config.training import TrainingConfig

    assert typing.get_type_hints(TrainingConfig)


# --------------------------------------------------------------------------- 4. example script


def test_sft_python_example_runs(doc_model, tmp_path, monkeypatch):
    """``examples/sft_python.py MODEL`` trains the tiny model briefly and saves it."""
    from grimoire.config.training import TrainingConfig

    original = TrainingConfig.__post_init__

    def capped(self):
        original(self)
        self.max_steps = min(self.max_steps or MAX_DOC_STEPS, MAX_DOC_STEPS)

    monkeypatch.setattr(TrainingConfig, "__post_init__", capped)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["sft_python.py", doc_model])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runpy.run_path(str(ROOT / "examples" / "sft_python.py"), run_name="__main__")
    saved = tmp_path / "output" / "sft-example" / "final"
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
    assert os.path.getsize(saved / "model.safetensors") > 0
