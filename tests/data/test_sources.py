"""Dataset sources: JSONL (with file:line errors), load_from_disk, max_samples, tokenize_dataset."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from grimoire.errors import ConfigError, DataError
from grimoire.model.tiny import build_tokenizer
from grimoire.rows.sft import tokenize_sft
from grimoire.rows.sources import (
    PACKAGE_ROOT,
    load_source,
    resolve_path,
    rows_to_dataset,
    source_problems,
    tokenize_dataset,
)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n):
    return [{"prompt": f"p{i}", "response": f"r{i}", "idx": i} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_jsonl_loads_rows_in_order(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(5))
    ds = load_source({"jsonl": str(path)}, "dataset")
    assert isinstance(ds, Dataset)
    assert ds["idx"] == [0, 1, 2, 3, 4]
    assert ds.column_names == ["prompt", "response", "idx"]


def test_jsonl_broken_lines_name_file_and_line(tmp_path):
    lines = [json.dumps(r) for r in _rows(9)]
    lines[6] = '{"prompt": "x", "response": '  # line 7: truncated JSON
    lines[8] = "[1, 2]"  # line 9: valid JSON but not an object
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_source({"jsonl": str(path)}, "dataset")
    problems = info.value.problems
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{path}:7: invalid JSON")
    assert problems[1].startswith(f"{path}:9: expected a JSON object, got list")


def test_blank_lines_are_skipped_and_columns_are_the_union(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2, "b": "late column"}\n')
    ds = load_source({"jsonl": str(path)}, "dataset")
    # Dataset.from_list would drop "b" (first-row keys only); we keep it.
    assert ds.column_names == ["a", "b"] and ds["b"] == [None, "late column"]


def test_missing_file_is_a_clear_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset\.jsonl: file not found: .*nope\.jsonl"):
        load_source({"jsonl": str(tmp_path / "nope.jsonl")}, "dataset")


def test_path_alias_accepts_json_array(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(_rows(3)))
    assert load_source({"path": str(path)}, "dataset")["idx"] == [0, 1, 2]
    bad = source_problems({"path": str(tmp_path / "folder")}, "dataset")
    assert any("dataset.path: folder not found" in p and "save_to_disk" in p for p in bad)


def test_path_to_a_folder_is_load_from_disk_as_in_grimoire_rl(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(_rows(4)).save_to_disk(str(tmp_path / "plain"))
    assert load_source({"path": str(tmp_path / "plain")}, "dataset")["idx"] == [0, 1, 2, 3]
    DatasetDict(
        {"train": Dataset.from_list(_rows(2)), "test": Dataset.from_list(_rows(3))}
    ).save_to_disk(str(tmp_path / "dict"))
    section = {"path": str(tmp_path / "dict"), "split": "test", "max_samples": 2}
    assert source_problems(section, "dataset") == []
    assert load_source(section, "dataset")["idx"] == [0, 1]


def test_section_problems_use_dotted_names_and_did_you_mean(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(2))
    problems = source_problems(
        {"jsonl": str(path), "max_sample": 3, "shuffle": "yes", "split": "train"}, "eval_dataset"
    )
    unknown = 'eval_dataset.max_sample: unknown key (did you mean "max_samples"?); valid keys: '
    assert any(p.startswith(unknown) and "max_samples, shuffle" in p for p in problems)
    assert any(p.startswith("eval_dataset.shuffle: must be bool") for p in problems)
    assert source_problems({}, "dataset") == [
        "dataset: give exactly one of ['name', 'jsonl', 'path', 'load_from_disk']; got none"
    ]
    two = source_problems({"jsonl": str(path), "name": "x/y"}, "dataset")
    assert "got ['name', 'jsonl']" in two[0]
    assert source_problems({"jsonl": str(path), "split": "train"}, "dataset") == [
        "dataset.split: only applies to name:, load_from_disk: and folder path: sources"
    ]
    assert source_problems({"jsonl": str(path), "max_samples": 0}, "d")[0].startswith(
        "d.max_samples: must be > 0"
    )
    assert source_problems({"jsonl": str(path), "max_samples": True}, "d")  # bool is not a count


def test_load_from_disk_dataset_and_dataset_dict(tmp_path):
    Dataset.from_list(_rows(4)).save_to_disk(str(tmp_path / "flat"))
    assert load_source({"load_from_disk": str(tmp_path / "flat")}, "dataset")["idx"] == [0, 1, 2, 3]

    dd = DatasetDict({"train": Dataset.from_list(_rows(3)), "test": Dataset.from_list(_rows(2))})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert len(load_source({"load_from_disk": str(tmp_path / "dict")}, "dataset")) == 3
    assert len(load_source({"load_from_disk": str(tmp_path / "dict"), "split": "test"}, "e")) == 2
    with pytest.raises(DataError, match=r"'tset' not in .*'test', 'train'.*did you mean \"test\""):
        load_source({"load_from_disk": str(tmp_path / "dict"), "split": "tset"}, "dataset")
    with pytest.raises(ConfigError, match="folder not found"):
        load_source({"load_from_disk": str(tmp_path / "none")}, "dataset")


def test_max_samples_and_seeded_shuffle(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(50))
    assert load_source({"jsonl": str(path), "max_samples": 4}, "d")["idx"] == [0, 1, 2, 3]
    a = load_source({"jsonl": str(path), "shuffle": True, "seed": 1, "max_samples": 10}, "d")
    b = load_source({"jsonl": str(path), "shuffle": True, "seed": 1, "max_samples": 10}, "d")
    c = load_source({"jsonl": str(path), "shuffle": True, "seed": 2, "max_samples": 10}, "d")
    assert a["idx"] == b["idx"] and len(a) == 10
    assert a["idx"] != list(range(10)) and a["idx"] != c["idx"]
    # More samples than rows keeps them all.
    assert len(load_source({"jsonl": str(path), "max_samples": 500}, "d")) == 50


def test_empty_file_is_a_data_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_source({"jsonl": str(path)}, "dataset")


def test_hub_dataset_offline_error_is_clear(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as info:
        load_source({"name": "grimoire-tests/does-not-exist", "split": "train"}, "dataset")
    msg = str(info.value)
    assert "dataset.name" in msg and "network access or a local copy" in msg


def test_grimoire_prefix_points_into_the_package():
    assert resolve_path("grimoire://assets/x.jsonl") == PACKAGE_ROOT / "assets" / "x.jsonl"
    assert (PACKAGE_ROOT / "__init__.py").is_file()
    assert str(resolve_path("rel/x.jsonl")) == "rel/x.jsonl"  # relative to the cwd


def test_tokenize_dataset_collects_every_bad_row(tokenizer):
    rows = _rows(7)
    del rows[3]["response"]  # missing field
    rows[5]["response"] = ""  # empty response
    ds = rows_to_dataset(rows)
    with pytest.raises(DataError) as info:
        tokenize_dataset(
            ds, tokenize_sft, source_name="dataset", tokenizer=tokenizer, max_length=32
        )
    problems = info.value.problems
    assert len(problems) == 2, problems
    assert problems[0].startswith("dataset row 3: tokenize_sft: missing field 'response'")
    assert problems[1] == "dataset row 5: tokenize_sft: field 'response' is empty"


def test_tokenize_dataset_keeps_only_returned_columns(tokenizer):
    ds = rows_to_dataset(_rows(4))
    out = tokenize_dataset(
        ds, tokenize_sft, source_name="dataset", tokenizer=tokenizer, max_length=32
    )
    assert sorted(out.column_names) == ["attention_mask", "input_ids", "labels"]
    assert len(out) == 4
    assert out[0]["input_ids"] == tokenize_sft(_rows(1)[0], tokenizer, 32)["input_ids"]


def test_tokenize_dataset_caps_the_listing():
    def always_bad(example):
        raise DataError([f"bad {example['idx']}"])

    with pytest.raises(DataError) as info:
        tokenize_dataset(rows_to_dataset(_rows(30)), always_bad, source_name="train")
    problems = info.value.problems
    assert len(problems) == 21
    assert problems[0] == "train row 0: bad 0" and problems[-1] == "... and 10 more"


def test_tokenize_dataset_other_errors_propagate_with_row_note():
    def buggy(example):
        if example["idx"] == 2:
            raise KeyError("oops")
        return {"x": [1]}

    with pytest.raises(KeyError) as info:
        tokenize_dataset(rows_to_dataset(_rows(4)), buggy, source_name="train")
    assert "while tokenizing train row 2" in getattr(info.value, "__notes__", [""])[0]
