"""The method contract (grimoire.contract.method): GrimoireLoss implements it with defaults,
online methods add the GeneratingMethod parts, as_method adapts duck types."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from grimoire.contract.method import (
    GENERATING_MEMBERS,
    GeneratingMethod,
    Method,
    PrecomputableMethod,
    generating,
)
from grimoire.forward.precomputed import check_precomputable
from grimoire.forward.reference import Reference
from grimoire.losses import (
    CPOLoss,
    DistillMethod,
    DPOLoss,
    GrimoireLoss,
    GRPOMethod,
    IPOLoss,
    KTOLoss,
    OnlineDPOMethod,
    ORPOLoss,
    RAFTMethod,
    RewardModelLoss,
    RLOOMethod,
    SFTLoss,
    SimPOLoss,
)
from grimoire.losses.base import (
    FORWARDED,
    GeneratingAdapter,
    MethodAdapter,
    PrecomputableAdapter,
    as_method,
)
from grimoire.losses.kto import cross_rank_mean
from grimoire.rollout.stage import RolloutStage
from grimoire.training.setup import build_rollouts

SRC = Path(__file__).resolve().parents[2] / "src" / "grimoire"
OFFLINE = (SFTLoss, DPOLoss, IPOLoss, SimPOLoss, CPOLoss, ORPOLoss, KTOLoss, RewardModelLoss)
ONLINE = (GRPOMethod, RLOOMethod, OnlineDPOMethod, RAFTMethod)


def protocol_members(protocol: type) -> set[str]:
    """The members ``protocol`` itself declares (its properties and methods)."""
    return {
        name
        for name, value in vars(protocol).items()
        if (not name.startswith("_") or name == "__call__")
        and (inspect.isfunction(value) or isinstance(value, property))
    }


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
    # Every member of the contract has a default in GrimoireLoss, and an adapter forwards all
    # of them but the four it answers itself.
    members = protocol_members(Method)
    assert len(members) == 23
    assert all(hasattr(GrimoireLoss, name) for name in members), members
    own = {"__call__", "create_collator", "method_name", "implementation"}
    assert set(FORWARDED) == members - own


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
    assert method.create_packed_collator(0) is None and not hasattr(method, "engine")
    assert not method.needs_generation and not method.needs_reference_model
    assert not method.holds_reference and method.fused_chunk_size == 1024
    assert generating(method) is None and not isinstance(method, PrecomputableMethod)
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
    # The parts the trainer hands the stage are the GeneratingMethod's; a method that does not
    # generate has none of them and gets no stage.
    assert generating(method) is method
    sft = SFTLoss()
    assert generating(sft) is None and build_rollouts(sft, None) is None  # type: ignore[arg-type]


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


def test_offline_losses_carry_no_generating_members_and_online_methods_all_of_them():
    members = set(GENERATING_MEMBERS) - {"reference_logps"}  # DPO / KTO: the cache's own
    for cls in OFFLINE:
        loss = cls()
        assert not isinstance(loss, GeneratingMethod), cls.__name__
        assert [m for m in members if hasattr(loss, m)] == [], cls.__name__
        assert generating(loss) is None
    for cls in ONLINE:
        method = cls(["exact_match"])
        assert isinstance(method, GeneratingMethod) and generating(method) is method
        assert all(hasattr(method, m) for m in GENERATING_MEMBERS), cls.__name__
    assert set(GENERATING_MEMBERS) == protocol_members(GeneratingMethod)


def test_a_method_that_says_it_generates_without_the_parts_is_refused_by_name():
    class Claims(SFTLoss):
        needs_generation = True

    with pytest.raises(TypeError, match=r"Claims sets needs_generation .* engine, reward_funcs"):
        generating(Claims())


class DuckOnline(Minimal):
    """A duck-typed method that generates: the three parts a stage cannot do without."""

    needs_generation = True

    def __init__(self):
        self.engine, self.sampling, self.calls = "an engine", "sampling", []

    def build_batches(self, ctx, groups):
        self.calls.append(groups)
        return [], {"n": float(len(groups))}


def test_a_duck_typed_method_that_generates_is_adapted_as_a_generating_method():
    obj = DuckOnline()
    method = as_method(obj)
    assert isinstance(method, GeneratingAdapter) and isinstance(method, GeneratingMethod)
    assert generating(method) is method
    assert method.engine == "an engine" and method.sampling == "sampling"
    assert method.build_batches(None, [1, 2]) == ([], {"n": 2.0}) and obj.calls == [[1, 2]]
    # Defaults: no reward functions, no old log-probs, no reference log-probs.
    assert tuple(method.reward_funcs) == () and method.needs_old_logps is False
    with pytest.raises(NotImplementedError, match="DuckOnline needs a reference model"):
        method.reference_logps({})
    obj.engine = "another"  # read live, like every forwarded member
    assert method.engine == "another"


def test_a_duck_typed_method_that_generates_without_an_engine_is_refused_at_once():
    class NoEngine(Minimal):
        needs_generation = True
        sampling = None

    with pytest.raises(TypeError, match="NoEngine sets needs_generation but has no engine, "):
        as_method(NoEngine())


def test_a_duck_typed_method_with_reference_logps_can_precompute_its_reference():
    class DuckCached(Minimal):
        needs_reference_model = True

        def __init__(self):
            self.reference = Reference(None, "DuckCached", ("ref_logps",))

        def reference_logps(self, model, batch):
            return [torch.ones(2)]

    method = as_method(DuckCached())
    assert isinstance(method, PrecomputableAdapter) and isinstance(method, PrecomputableMethod)
    assert method.reference_logps(None, {})[0].tolist() == [1.0, 1.0]
    check_precomputable(method)  # no error
    assert isinstance(DPOLoss(), PrecomputableMethod) and isinstance(KTOLoss(), PrecomputableMethod)
    with pytest.raises(Exception, match="uses no reference model"):
        check_precomputable(SFTLoss())
    with pytest.raises(Exception, match="is an online method"):
        check_precomputable(GRPOMethod(["exact_match"], beta=0.1))


def test_holds_reference_is_true_only_for_a_reference_given_as_a_module():
    module = torch.nn.Linear(2, 2)
    assert DPOLoss(ref_model=module).holds_reference
    assert not DPOLoss().holds_reference and not DPOLoss(ref_model="copy").holds_reference
    assert not SFTLoss().holds_reference  # no reference at all
    assert DistillMethod(teacher=module).holds_reference  # distillation's teacher

    class DuckRef(Minimal):
        reference = Reference(module, "DuckRef")

    assert as_method(DuckRef()).holds_reference  # the adapter's default reads its reference


def _method_probes() -> list[str]:
    """``getattr`` / ``hasattr`` calls on a method (or its reference) anywhere in src/."""
    names = {"method", "loss_fn", "loss", "online", "scoring", "wrapped"}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
            ):
                continue
            chain, target = [], node.args[0]
            while isinstance(target, ast.Attribute):  # method.reference, self.wrapped
                chain.append(target.attr)
                target = target.value
            if isinstance(target, ast.Name) and names & {target.id, *chain}:
                found.append(f"{path.relative_to(SRC).as_posix()}:{node.lineno}")
    return found


def test_no_code_probes_a_method_but_the_adapter():
    # Everything else calls the contract. The adapter reads a duck type's contract members in one
    # place (_defined) and passes its other attributes through (__getattr__).
    source = (SRC / "losses" / "base.py").read_text().splitlines()
    lines = [i for i, line in enumerate(source, 1) if "getattr(method, name" in line]
    lines += [i for i, line in enumerate(source, 1) if "getattr(self.wrapped, name)" in line]
    assert len(lines) == 2
    assert _method_probes() == [f"losses/base.py:{i}" for i in sorted(lines)]
