"""The method contract (grimoire.contract.method): a core of three members every method defines,
opt-in capabilities with GrimoireLoss's defaults, the GeneratingMethod parts of online methods,
and as_method, which refuses a duck type without the core and adapts one with it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from grimoire.contract.method import (
    CAPABILITIES,
    CORE_MEMBERS,
    GENERATING_MEMBERS,
    GeneratingMethod,
    Method,
    MethodCore,
    PrecomputableMethod,
    ScoresReference,
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
from grimoire.losses.adapter import (
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


class Minimal:  # a duck-typed method: the core and nothing else
    def __call__(self, model, batch, training=True):
        return torch.tensor(float(training)), {}

    def create_collator(self, pad_token_id):
        return ("collator", pad_token_id)

    def loss_weight(self, batch):
        return 2.0


def test_the_contract_is_a_core_of_three_and_opt_in_capabilities():
    with pytest.raises(TypeError, match="abstract"):
        GrimoireLoss()  # type: ignore[abstract]
    assert (
        protocol_members(MethodCore)
        == set(CORE_MEMBERS)
        == {
            "__call__",
            "create_collator",
            "loss_weight",
        }
    )
    # Every other member of Method is a capability (or the identity the run answers itself),
    # each with its default in GrimoireLoss, which leaves exactly the core abstract.
    identity = {"method_name", "implementation"}
    assert protocol_members(Method) == set(CAPABILITIES) | identity
    assert len(CAPABILITIES) == len(set(CAPABILITIES))
    assert all(hasattr(GrimoireLoss, name) for name in CAPABILITIES)
    assert GrimoireLoss.__abstractmethods__ == frozenset(CORE_MEMBERS)
    # The adapter answers every member of the contract itself: none reaches __getattr__.
    for name in (*CORE_MEMBERS, *CAPABILITIES, *identity):
        assert name in vars(MethodAdapter), name


def test_reference_logps_has_one_signature():
    """Declared once (ScoresReference), the same for the reference cache and the rollout."""
    assert protocol_members(ScoresReference) == {"reference_logps"}
    assert "reference_logps" not in vars(PrecomputableMethod)
    assert "reference_logps" not in vars(GeneratingMethod)
    expected = ["self", "model", "batch"]
    for cls in (DPOLoss, KTOLoss, GRPOMethod, PrecomputableAdapter, GeneratingAdapter):
        params = list(inspect.signature(cls.reference_logps).parameters)
        assert params == expected, cls.__name__


def test_as_method_keeps_a_method_and_adapts_a_duck_type():
    sft = SFTLoss()
    assert as_method(sft) is sft
    method = as_method(Minimal())
    assert isinstance(method, MethodAdapter) and as_method(method) is method
    assert method.method_name == "Minimal"
    assert float(method(None, {}, training=False)[0]) == 0.0
    assert method.create_collator(3) == ("collator", 3)
    batch = {"input_ids": torch.zeros(4, 2, dtype=torch.long)}
    assert method.loss_weight(batch) == 2.0  # its own: the core is never defaulted
    # GrimoireLoss's defaults for every capability it leaves out.
    assert method.validate_dataset([{"x": 1}], "train") == []
    assert method.create_packed_collator(0) is None and not hasattr(method, "engine")
    assert not method.needs_generation and not method.needs_reference_model
    assert not method.holds_reference and method.fused_chunk_size == 1024 and method.fused
    assert generating(method) is None and not isinstance(method, PrecomputableMethod)
    assert method.steps_per_batch == 1 and method.budget_hint == "" and method.reference is None
    assert method.model_kind == "causal_lm" and method.logp_reduction == "sum"
    assert method.required_columns == ()
    assert method.budget_tokens({"": 3, "kl_": 5}, True) == 8
    assert method.fit_to_budget({"input_ids": [1, 2, 3]}, 2) == {"input_ids": [1, 2]}
    assert method.cache_rows("rows") == "rows" and method.adapt_rows("rows", None) == "rows"
    assert method.setup(None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("loss_weight", r"Minimal is not a training method: it has no loss_weight\. "),
        ("create_collator", "it has no create_collator. Define create_collator"),
    ],
)
def test_a_duck_type_without_the_core_is_refused_naming_the_member(drop, named):
    cls = type("Minimal", (), {k: v for k, v in vars(Minimal).items() if k != drop})
    with pytest.raises(TypeError, match=named) as err:
        as_method(cls())
    if drop == "loss_weight":  # says what to return, and why no default is guessed
        assert "num_targets(batch)" in str(err.value) and "no default" in str(err.value)


def test_an_adapter_forwards_what_the_object_defines_live():
    class Rich(Minimal):
        steps_per_batch = 3
        budget_hint = ", and more"
        required_columns = ("input_ids", "labels")
        beta = 0.5

        def budget_tokens(self, lengths, packed):
            return 99

    obj = Rich()
    method = as_method(obj)
    assert method.steps_per_batch == 3 and method.budget_hint == ", and more"
    assert method.loss_weight({}) == 2.0 and method.budget_tokens({}, False) == 99
    assert method.beta == 0.5  # a method's own setting, read through
    obj.steps_per_batch = 5
    assert method.steps_per_batch == 5
    # The default data check reads the object's required_columns, as GrimoireLoss's does.
    (problem,) = method.validate_dataset([{"input_ids": [1]}], "train")
    assert "missing column(s) ['labels'] needed by Rich" in problem


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
    assert set(GENERATING_MEMBERS) == protocol_members(GeneratingMethod) | {"reference_logps"}


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
    # Defaults: no reward functions, no old log-probs, synchronous, single completions.
    assert tuple(method.reward_funcs) == () and method.needs_old_logps is False
    assert method.max_staleness == 0 and method.agent is None
    obj.engine = "another"  # read live, like every forwarded member
    assert method.engine == "another"


def test_a_duck_typed_method_that_generates_without_an_engine_is_refused_at_once():
    class NoEngine(Minimal):
        needs_generation = True
        sampling = None

    with pytest.raises(TypeError, match="NoEngine sets needs_generation but has no engine, "):
        as_method(NoEngine())

    class NoReference(DuckOnline):
        needs_reference_model = True

    with pytest.raises(TypeError, match="NoReference sets needs_generation but has no "):
        as_method(NoReference())


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
    source = (SRC / "losses" / "adapter.py").read_text().splitlines()
    lines = [i for i, line in enumerate(source, 1) if "getattr(method, name" in line]
    lines += [i for i, line in enumerate(source, 1) if "getattr(self.wrapped, name)" in line]
    assert len(lines) == 2
    assert _method_probes() == [f"losses/adapter.py:{i}" for i in sorted(lines)]
