"""Asynchronous rollouts (``max_staleness``) with the ``vllm-server`` engine, against the real
HTTP handler of ``grimoire vllm-serve`` serving a stand-in sampler (no vLLM; the same with a real
vLLM server is in tests/vllm_backend).

What is proved: the producer pushes the SAMPLER's weights (the version that samples the step),
so every step's request is served with the weights of at most ``k`` steps before; the old
log-probs are that version's, the server's log-probs stay ``sampler_logps``; two engines sharing
one server (the sampler's copy and the learner's, which evaluates) each push again when the
other pushed last; several training processes are refused, naming the key.
"""

from __future__ import annotations

import time

import pytest
import torch
from tests.helpers.episodes import LOGP, Narrator, answer_length
from tests.helpers.stand_in_server import serving, serving_turns
from tests.helpers.train_utils import quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grimoire import GrimoireTrainer
from grimoire.forward.completions import batch_completion_logps
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import reverse_rows
from grimoire.rollout.async_rollouts import AsyncRolloutStage, async_problems
from grimoire.rollout.engines.vllm_server import VLLMServerEngine, read_frames
from grimoire.rollout.rewards.scoring import char_match_reward
from grimoire.rows.prompts import tokenize_grpo
from grimoire.training.callbacks import TrainerCallback


class Recording:
    """vLLM's side: records every pushed state and, per request, which push served it; samples
    ``1 + k % 3`` letters then EOS for the k-th copy of a prompt, each at log-prob ``LOGP``."""

    def __init__(self, config, letters, eos):
        self.config, self.letters, self.eos = config, letters, eos
        self.pushed: list[dict[str, torch.Tensor]] = []
        self.served: list[int] = []

    def info(self):
        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        return {"ok": True, "config": {k: getattr(self.config, k) for k in keys}}

    def generate(self, request):
        self.served.append(len(self.pushed) - 1)
        ids = []
        for _prompt, p in zip(request["prompts"], request["params"], strict=True):
            ids += [self.letters[: 1 + k % 3] + [self.eos] for k in range(p["n"])]
        return {"ids": ids, "logps": [[LOGP] * len(i) for i in ids]}

    def load_weights(self, stream):
        self.pushed.append(dict(read_frames(stream)))
        return {"ok": True}


@pytest.fixture
def served(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    sampler = Recording(model.config, tok.convert_tokens_to_ids(list("abc")), tok.eos_token_id)
    with serving(sampler) as url:
        yield sampler, url


class Versions(TrainerCallback):
    """The policy's weights after each step (version ``step``), each step's metrics and its
    batches; a slower learner (0.2 s) keeps the producer ahead, so staleness reaches k."""

    def __init__(self, model):
        self.versions = {0: {k: v.clone() for k, v in model.state_dict().items()}}
        self.metrics: list[dict[str, float]] = []

    def on_step_end(self, trainer, step, loss, metrics) -> None:
        time.sleep(0.2)
        self.metrics.append(dict(metrics))
        state = trainer.unwrapped_model.state_dict()
        self.versions[step] = {k: v.clone() for k, v in state.items()}


def _train(tiny_dir, tmp_path, monkeypatch, method, steps, rows, check=None, **config):
    """Train ``method`` ``steps`` steps on ``rows`` reverse rows with a slow learner
    (:class:`Versions`); returns it and every trained batch as ``(learner step, batch)``.
    ``check(trainer)`` runs before training."""
    batches: list[tuple[int, dict]] = []
    compute = GRPOMethod.compute_loss

    def recording(self, model, batch):
        batches.append((self._ctx.step.global_step, dict(batch)))
        return compute(self, model, batch)

    monkeypatch.setattr(GRPOMethod, "compute_loss", recording)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    data = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(rows, seed=3)]
    config = quiet_config(
        tmp_path,
        max_steps=steps,
        batch_size=2,
        learning_rate=1e-2,
        disable_dropout=True,
        seed=0,
        **config,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    versions = Versions(model)
    trainer = GrimoireTrainer(
        model=model,
        tokenizer=tok,
        config=config,
        loss_fn=method,
        train_dataset=data,
        callbacks=[versions],
    )
    try:
        if check is not None:
            check(trainer)
        trainer.train()
    finally:
        trainer.close()
    return versions, batches


def _version_of(state, versions) -> int:
    found = [v for v, w in versions.items() if all(torch.equal(state[k], w[k]) for k in w)]
    assert len(found) == 1, found
    return found[0]


def test_async_vllm_server_samples_each_step_with_the_weights_at_most_k_old(
    served, tiny_dir, tmp_path, monkeypatch
):
    sampler, url = served
    method = GRPOMethod(
        [char_match_reward],
        num_generations=4,
        max_new_tokens=4,
        max_staleness=1,
        engine={"type": "vllm-server", "args": {"url": url}},
    )

    def check(trainer) -> None:
        stage = trainer.rollouts
        assert isinstance(stage, AsyncRolloutStage)
        assert stage.sampler_engine.policy is stage.sampler_model  # its own copy, not ours

    versions, batches = _train(tiny_dir, tmp_path, monkeypatch, method, 4, 16, check=check)
    assert [m["staleness/max"] for m in versions.metrics] == [0.0, 1.0, 1.0, 1.0]
    # Request s (one per step: one micro-batch) was served with version s - 1 (step 0: 0),
    # pushed by the producer for it: never the learner's newer weights.
    served_with = [_version_of(sampler.pushed[i], versions.versions) for i in sampler.served]
    assert served_with[:4] == [0, 0, 1, 2]
    assert len(sampler.pushed) == len(set(sampler.served))  # each push served a request
    for step, batch in batches:
        mask = batch["completion_mask"].float()
        # The server's log-probs stay the importance-sampling correction's ...
        torch.testing.assert_close(batch["sampler_logps"], LOGP * mask)
        # ... and the old log-probs are the sampling version's forward, not the learner's.
        probe = AutoModelForCausalLM.from_pretrained(tiny_dir)
        probe.load_state_dict(versions.versions[max(0, step - 1)])
        with torch.no_grad():
            want, _ = batch_completion_logps(probe, batch, 1.0, fused=False)
        torch.testing.assert_close(batch["old_logps"] * mask, want * mask, atol=1e-5, rtol=0)


def test_engines_sharing_one_server_push_again_after_the_other_pushed(served, tiny_dir):
    """The learner's engine (evaluation) and the async sampler's copy share one server: a
    push by one makes the other push its own weights before its next request."""
    import copy

    sampler, url = served
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    learner = AutoModelForCausalLM.from_pretrained(tiny_dir)
    other = copy.deepcopy(learner)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)  # tell the two apart
    a = VLLMServerEngine(max_new_tokens=3, url=url)
    a.bind(learner, tok.pad_token_id, tok.eos_token_id)
    b = copy.copy(a)
    b.bind(other, tok.pad_token_id, tok.eos_token_id)
    prompt = [[5, 6, 7]]
    a.generate(prompt, 2)
    a.generate(prompt, 2)  # nothing changed, nothing pushed
    b.generate(prompt, 2)
    a.generate(prompt, 2)
    assert len(sampler.pushed) == 3 and sampler.served == [0, 0, 1, 2]
    states = [learner.state_dict(), other.state_dict(), learner.state_dict()]
    for pushed, want in zip(sampler.pushed, states, strict=True):
        assert all(torch.equal(pushed[k], v) for k, v in want.items())


def test_async_vllm_server_on_several_processes_is_refused_naming_the_key(served):
    _, url = served
    engine = VLLMServerEngine(url=url)
    problems = async_problems("loss.args.max_staleness", 1, engine, processes=2)
    assert len(problems) == 1 and "loss.args.max_staleness=1 with engine vllm-server" in problems[0]
    assert async_problems("loss.args.max_staleness", 1, engine, processes=1) == []


@pytest.fixture
def turns(tiny_dir):
    with serving_turns(tiny_dir) as served:
        yield served


def test_async_episodes_old_logps_are_the_sampling_weights_over_the_whole_episode(
    turns, tiny_dir, tmp_path, monkeypatch
):
    """Episodes (two turns and a tool message each) sampled ahead by the producer: the old
    log-probs of every trained episode are the forward of the version that played it (one step
    behind), over the whole episode; the server's log-probs land on the model's tokens only."""
    _, url = turns
    method = GRPOMethod(
        [answer_length],
        num_generations=4,
        max_staleness=1,
        engine={"type": "vllm-server", "args": {"url": url}},
        environment=Narrator,
        stop_tokens=["<|end|>"],
        tool_call_parser="tiny",
        max_turns=3,
        max_episode_tokens=96,
        max_new_tokens=8,
        fused=False,
    )
    versions, batches = _train(tiny_dir, tmp_path, monkeypatch, method, 3, 8, padding_free=False)
    assert [m["staleness/max"] for m in versions.metrics] == [0.0, 1.0, 1.0]
    assert all(m["episode/turns_mean"] == 2.0 for m in versions.metrics)
    probe = AutoModelForCausalLM.from_pretrained(tiny_dir)
    for step, batch in batches:
        mask = batch["completion_mask"].float()
        context = (batch["attention_mask"][:, -mask.shape[1] :] == 1) & (mask == 0)
        assert context.any(dim=1).all(), "every episode has tool tokens in its completion"
        torch.testing.assert_close(batch["sampler_logps"], LOGP * mask)
        errors = {}
        for version in {max(0, step - 1), step}:
            probe.load_state_dict(versions.versions[version])
            with torch.no_grad():
                want, _ = batch_completion_logps(probe, batch, 1.0, fused=False)
            errors[version] = float(((batch["old_logps"] - want) * mask).abs().max())
        assert errors[max(0, step - 1)] < 1e-5, errors
        if step > 0:
            assert errors[step] > 1e-4, errors  # not the learner's weights


def test_async_episodes_with_the_sampler_process_are_refused_naming_the_setting():
    from grimoire.rollout.engines.hf import HFGenerateEngine

    problems = async_problems("loss.args.max_staleness", 1, HFGenerateEngine(), episodes=True)
    assert len(problems) == 1 and "engine.args.async_sampler: thread" in problems[0]
    thread = HFGenerateEngine(async_sampler="thread")
    assert async_problems("loss.args.max_staleness", 1, thread, episodes=True) == []
