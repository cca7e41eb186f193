"""The method contract: GrimoireLoss declares every capability; as_method adapts duck types."""

from __future__ import annotations

import inspect

import pytest
import torch

from grimoire.losses import GrimoireLoss, GRPOMethod, KTOLoss, SFTLoss
from grimoire.losses.base import FORWARDED, MethodAdapter, as_method
from grimoire.losses.kto import cross_rank_mean
from grimoire.rollout.stage import RolloutStage
from grimoire.training.setup import build_rollouts


class Minimal:  # the documented duck-typed protocol
    def __call__(self, model, batch, training=True):
        return torch.tensor(float(training)), {}

    def create_collator(self, pad_token_id):
        return ("collator", pad_token_id)


def test_the_contract_is_abstract_and_declares_every_capability():
    with pytest.raises(TypeError, match="abstract"):
        GrimoireLoss()  # type: ignore[abstract]
    for name in FORWARDED:
        assert hasattr(GrimoireLoss, name), name


def test_as_method_keeps_a_method_and_adapts_a_duck_type():
    sft = SFTLoss()
    assert as_method(sft) is sft
    method = as_method(Minimal())
    assert isinstance(method, MethodAdapter) and as_method(method) is method
    assert method.method_name == "Minimal"
    assert float(method(None, {}, training=False)[0]) == 0.0
    assert method.create_collator(3) == ("collator", 3)
    # The defaults the trainer always gave such objects.
    batch = {"input_ids": torch.zeros(4, 2, dtype=torch.long)}
    assert method.loss_weight(batch) == 1.0
    assert GrimoireLoss.loss_weight(sft, batch) == 4.0  # the contract's default: rows
    assert method.validate_dataset([{"x": 1}], "train") == []
    assert method.create_packed_collator(0) is None and method.engine is None
    assert not method.needs_generation and not method.needs_reference_model
    assert method.steps_per_batch == 1 and method.budget_hint == "" and method.reference is None
    assert method.budget_tokens({"": 3, "kl_": 5}, True) == 8
    assert method.fit_to_budget({"input_ids": [1, 2, 3]}, 2) == {"input_ids": [1, 2]}
    assert method.cache_rows("rows") == "rows"


def test_an_adapter_forwards_what_the_object_defines_live():
    class Rich(Minimal):
        steps_per_batch = 3
        budget_hint = ", and more"
        beta = 0.5

        def loss_weight(self, batch):
            return 7.0

        def budget_tokens(self, lengths, packed):
            return 99

    obj = Rich()
    method = as_method(obj)
    assert method.steps_per_batch == 3 and method.budget_hint == ", and more"
    assert method.loss_weight({}) == 7.0 and method.budget_tokens({}, False) == 99
    assert method.beta == 0.5  # a method's own setting, read through
    obj.steps_per_batch = 5
    assert method.steps_per_batch == 5


def test_the_trainer_builds_the_rollout_stage_from_the_methods_parts():
    method = GRPOMethod(["exact_match"], num_iterations=2)
    assert method.steps_per_batch == 2 and not hasattr(method, "rollouts")
    parts = inspect.signature(RolloutStage).parameters
    assert "method" not in parts and {"engine", "build_batches", "reference_logps"} <= set(parts)
    # The contract names every part the trainer hands the stage, with a default for methods
    # that do not generate.
    sft = SFTLoss()
    assert sft.engine is None and list(sft.reward_funcs) == [] and sft.sampling is None
    assert build_rollouts(sft, None) is None


def test_kto_cross_rank_mean_goes_through_the_context():
    class Ctx:
        num_processes = 2

        def __init__(self):
            self.calls = 0

        def all_reduce_sum_tensor(self, tensor):
            self.calls += 1
            return tensor * 2  # as if the other rank held the same (sum, count)

    assert cross_rank_mean(3, None) is None
    single = Ctx()
    single.num_processes = 1
    assert cross_rank_mean(3, single) is None
    ctx = Ctx()
    reduce = cross_rank_mean(3, ctx)
    assert reduce is not None
    assert float(reduce(torch.tensor(0.25))) == pytest.approx(0.25) and ctx.calls == 1
    assert KTOLoss()._ctx is None  # set by setup
