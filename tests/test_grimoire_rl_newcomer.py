"""A grimoire-rl 2.1.3 user's code, as written against its public API, runs here (issue #28, item 7).

Each test is a script such a user writes (only the model swapped for a tiny local one), run as a
real command: ``python script.py`` in an empty folder, importing this checkout. The walls it hit
before: ``GRPOMethod(reward_fn=..., tokenizer=...)`` (and RLOO, Online DPO, RAFT), KTO rows
labelled ``kto_label``, ``TrainingConfig(neftune_alpha=...)``, ``grimoire.data.sft.
PackedSFTCollator``, ORPO's ``or_loss`` metric, and a model whose ``disable_adapter()`` makes it
its own reference. The differences kept on purpose are in docs/migrating-from-grimoire-rl.md.
"""

from __future__ import annotations

import json
import math

from tests.helpers.commands import grimoire_command, run, run_python

PRELUDE = """
import json
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from grimoire import GrimoireTrainer, TrainingConfig
from grimoire.model.tiny import kto_rows, preference_rows, reverse_rows, save_tiny

torch.manual_seed(0)
model_path = str(save_tiny("tiny-model"))  # was: "meta-llama/Llama-3.2-1B"
tokenizer = AutoTokenizer.from_pretrained(model_path)


def config(name, **overrides):
    values = dict(output_dir=name, max_steps=2, batch_size=4, learning_rate=1e-2,
                  mixed_precision="no", gradient_checkpointing=False, progress_bar=False,
                  save_on_epoch_end=False, logging_steps=1)
    values.update(overrides)
    return TrainingConfig(**values)


def records(name):
    return [json.loads(line) for line in open(f"{name}/metrics.jsonl")]


def frozen_reference():
    return AutoModelForCausalLM.from_pretrained(model_path).eval()
"""


def script_output(tmp_path, body: str) -> dict:
    out = run_python(PRELUDE + body, tmp_path)
    return json.loads(out.strip().splitlines()[-1])


def test_online_methods_take_reward_fn_and_tokenizer(tmp_path):
    out = script_output(
        tmp_path,
        """
from grimoire.data import tokenize_grpo
from grimoire.errors import ConfigError
from grimoire.losses import GRPOMethod, OnlineDPOMethod, RAFTMethod, RLOOMethod


def reward_fn(prompts, completions):  # grimoire-rl's two-argument reward
    return [len(c) / 8 for c in completions]


prompts = [tokenize_grpo(r, tokenizer, max_length=32) for r in reverse_rows(8, seed=0)]
out = {"steps": {}, "positional": {}}
for cls in (GRPOMethod, RLOOMethod, OnlineDPOMethod, RAFTMethod):
    extra = {"ref_model": frozen_reference()} if cls in (RLOOMethod, OnlineDPOMethod) else {}
    method = cls(reward_fn=reward_fn, tokenizer=tokenizer, num_generations=2, max_new_tokens=4,
                 **extra)
    name = cls.__name__
    model = AutoModelForCausalLM.from_pretrained(model_path)
    GrimoireTrainer(model=model, tokenizer=tokenizer, config=config(name, batch_size=2),
                    loss_fn=method, train_dataset=prompts).train()
    out["steps"][name] = records(name)[-1]["step"]
    positional = cls(reward_fn, tokenizer, num_generations=3)
    out["positional"][name] = [positional.peer_tokenizer is tokenizer,
                               positional.num_generations]

# The same tokenizer loaded a second time is accepted; a different one stops before training.
for name, tok in (("reloaded", AutoTokenizer.from_pretrained(model_path)), ("other", None)):
    if tok is None:
        tok = AutoTokenizer.from_pretrained(model_path)
        tok.add_tokens(["<extra>"])
    method = GRPOMethod(reward_fn=reward_fn, tokenizer=tok, num_generations=2, max_new_tokens=4)
    try:
        GrimoireTrainer(model=AutoModelForCausalLM.from_pretrained(model_path),
                        tokenizer=tokenizer, config=config(name, max_steps=1, batch_size=2),
                        loss_fn=method, train_dataset=prompts).train()
        out[name] = "trained"
    except ConfigError as exc:
        out[name] = str(exc)
print(json.dumps(out))
""",
    )
    names = ["GRPOMethod", "RLOOMethod", "OnlineDPOMethod", "RAFTMethod"]
    assert out["steps"] == dict.fromkeys(names, 2)
    assert out["positional"] == {n: [True, 3] for n in names}
    assert out["reloaded"] == "trained"
    assert (
        "GRPOMethod(tokenizer=...) differs from the tokenizer given to GrimoireTrainer"
        in (out["other"])
    )
    assert "vocabulary" in out["other"] and "drop tokenizer=" in out["other"]


def test_kto_rows_labelled_kto_label_train_and_cache(tmp_path):
    out = script_output(
        tmp_path,
        """
from datasets import Dataset
from grimoire.data import cache_reference_log_probs, tokenize_kto
from grimoire.losses import KTOLoss

# What grimoire-rl's tokenize_kto returns: input_ids, attention_mask, labels, kto_label.
rows = []
for r in kto_rows(8, seed=0):
    row = tokenize_kto(r, tokenizer, max_length=32)
    row["kto_label"] = row.pop("label")
    rows.append(row)
dataset = Dataset.from_list(rows)
out = {"columns": sorted(dataset.column_names)}
model = AutoModelForCausalLM.from_pretrained(model_path)
GrimoireTrainer(model=model, tokenizer=tokenizer, config=config("kto"),
                loss_fn=KTOLoss(ref_model=frozen_reference()), train_dataset=dataset).train()
out["kto"] = records("kto")[-1]
cached = cache_reference_log_probs(frozen_reference(), dataset, batch_size=4)
model = AutoModelForCausalLM.from_pretrained(model_path)
GrimoireTrainer(model=model, tokenizer=tokenizer, config=config("cached"), loss_fn=KTOLoss(),
                train_dataset=cached).train()
out["cached"] = records("cached")[-1]
print(json.dumps(out))
""",
    )
    assert out["columns"] == ["attention_mask", "input_ids", "kto_label", "labels"]
    for run_name in ("kto", "cached"):
        last = out[run_name]
        assert last["step"] == 2 and math.isfinite(last["loss"])
        # Both classes reached the loss, read from kto_label (4 desirable, 4 undesirable rows).
        assert last["count/chosen"] > 0 and last["count/rejected"] > 0


def test_neftune_alpha_is_neftune_noise_alpha_in_python_and_yaml(tmp_path):
    out = script_output(
        tmp_path,
        """
from grimoire.data import tokenize_sft
from grimoire.losses import SFTLoss

cfg = config("neftune", neftune_alpha=5.0)
rows = [tokenize_sft(r, tokenizer, max_length=32) for r in reverse_rows(8, seed=0)]
model = AutoModelForCausalLM.from_pretrained(model_path)
trainer = GrimoireTrainer(model=model, tokenizer=tokenizer, config=cfg, loss_fn=SFTLoss(),
                          train_dataset=rows)
embed, ids = model.get_input_embeddings(), torch.tensor([rows[0]["input_ids"]])
model.train()
noisy = not torch.equal(embed(ids), embed(ids))  # fresh noise in every training forward
model.eval()
clean = torch.equal(embed(ids), embed(ids))
trainer.train()
print(json.dumps({"alpha": cfg.neftune_noise_alpha, "noisy": noisy, "clean": clean,
                  "step": records("neftune")[-1]["step"]}))
""",
    )
    assert out == {"alpha": 5.0, "noisy": True, "clean": True, "step": 2}
    # The YAML `training:` section mirrors TrainingConfig: grimoire-rl's key works there too.
    (tmp_path / "neftune.yaml").write_text(
        "model: {pretrained: 'tiny:llama'}\n"
        "dataset: {jsonl: grimoire://assets/reverse_eval.jsonl, max_samples: 16}\n"
        "training: {output_dir: out, max_steps: 2, batch_size: 8, neftune_alpha: 5.0,\n"
        "           mixed_precision: 'no', progress_bar: false}\n"
        "save_to: false\n"
    )
    run([*grimoire_command(), "train", "--config", "neftune.yaml"], tmp_path)
    assert [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").open()][-1] == 2


def test_packed_sft_collator_from_grimoire_data_sft(tmp_path):
    out = script_output(
        tmp_path,
        """
from grimoire.data import tokenize_sft
from grimoire.data.sft import PackedSFTCollator
from grimoire.losses import SFTLoss

rows = [tokenize_sft(r, tokenizer, max_length=64) for r in reverse_rows(8, seed=0)]
losses = {}
for name, collator in (("packed", PackedSFTCollator(pad_token_id=tokenizer.pad_token_id,
                                                    max_length=64)),
                       ("padded", None)):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    GrimoireTrainer(model=model, tokenizer=tokenizer, data_collator=collator,
                    config=config(name, padding_free=False), loss_fn=SFTLoss(),
                    train_dataset=rows).train()
    losses[name] = [r["loss"] for r in records(name)]
print(json.dumps(losses))
""",
    )
    # Packed rows attend within each sample only, so the losses are the padded ones.
    assert len(out["packed"]) == 2
    for packed, padded in zip(out["packed"], out["padded"]):
        assert math.isclose(packed, padded, rel_tol=1e-5), out


def test_orpo_logs_or_loss(tmp_path):
    out = script_output(
        tmp_path,
        """
from grimoire.data import tokenize_preference
from grimoire.losses import ORPOLoss

rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(8, seed=0)]
model = AutoModelForCausalLM.from_pretrained(model_path)
GrimoireTrainer(model=model, tokenizer=tokenizer, config=config("orpo"), loss_fn=ORPOLoss(),
                train_dataset=rows).train()
print(json.dumps(records("orpo")))
""",
    )
    assert len(out) == 2
    for rec in out:
        assert rec["or_loss"] > 0  # -beta * log sigma(.) is positive
        assert math.isclose(rec["loss"], rec["nll_loss"] + rec["or_loss"], rel_tol=1e-5), rec


def test_a_model_with_disable_adapter_is_its_own_reference(tmp_path):
    out = script_output(
        tmp_path,
        """
import contextlib
from grimoire.data import tokenize_preference
from grimoire.losses import DPOLoss


class BiasAdapter(torch.nn.Module):
    '''A frozen base plus a trainable bias on its input embeddings; not a peft model.
    disable_adapter() is grimoire-rl's contract: inside it, the model is its reference.'''

    def __init__(self, base):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.config = base.config
        self.bias = torch.nn.Parameter(torch.zeros(base.config.hidden_size))
        self.enabled = True
        base.get_input_embeddings().register_forward_hook(
            lambda module, args, output: output + self.bias if self.enabled else output
        )

    @contextlib.contextmanager
    def disable_adapter(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def get_input_embeddings(self):
        return self.base.get_input_embeddings()

    def forward(self, **kwargs):
        return self.base(**kwargs)


rows = [tokenize_preference(r, tokenizer, max_length=64) for r in preference_rows(8, seed=0)]
model = BiasAdapter(AutoModelForCausalLM.from_pretrained(model_path))
trainer = GrimoireTrainer(model=model, tokenizer=tokenizer, config=config("dpo"),
                          loss_fn=DPOLoss(), train_dataset=rows)
trainer.train()
print(json.dumps({"source": trainer.loss_fn.reference.source,
                  "margins": [r["rewards/margins"] for r in records("dpo")],
                  "bias_norm": float(model.bias.norm())}))
""",
    )
    assert out["source"] == "adapters"
    # Step 1: the bias is still zero, so policy == reference exactly; after one update the
    # policy moved and the reference (adapter off) did not, so the implicit rewards differ.
    assert out["margins"][0] == 0.0 and out["margins"][1] != 0.0
    assert out["bias_norm"] > 0
