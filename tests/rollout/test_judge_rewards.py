"""``llm_judge``: an LLM judge behind an OpenAI-compatible endpoint as a reward function, and the
scoring of slow rewards overlapped with the next micro-batch's sampling.

A stand-in judge (:mod:`tests.helpers.judge_server`) serves on loopback: it scores a request by
its message's length, can answer late, fail or answer nonsense, and records when each request
arrived, so the overlap is observed from the judge's side against the sampler's own intervals.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from tests.helpers.judge_server import JudgeServer, judge_score
from tests.rollout.test_async_rollouts import _run

from grimoire.errors import ConfigError
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.rewards.background import BackgroundScoring
from grimoire.rollout.rewards.calls import resolve_reward_funcs
from grimoire.rollout.rewards.judge import LLMJudge, read_score
from grimoire.rollout.rewards.scoring import RewardFunctionError, score_completions

TEMPLATE = "Question: {prompt}\nReference: {answer}\nAnswer: {completion}\nScore 0-10:"


@pytest.fixture(scope="module")
def judge_server():
    server = JudgeServer()
    try:
        yield server
    finally:
        server.close()


def _judge(server: JudgeServer, mode: str = "", **args) -> LLMJudge:
    return LLMJudge(base_url=server.url(mode), model="judge-1", prompt=TEMPLATE, **args)


# ------------------------------------------------------------------ the reward function


def test_judge_scores_are_the_endpoints_replies_read_as_numbers(judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    judge = _judge(judge_server, system="Be strict.", api_key_env="JUDGE_KEY", max_concurrency=3)
    prompts, completions = ["2+2?", "capital of France?", "x"], ["4", "Paris", ""]
    answer = ["4", "Paris", "y"]
    before = len(judge_server.requests)
    scores = judge(prompts=prompts, completions=completions, answer=answer)
    expected = [
        judge_score(f"Question: {p}\nReference: {a}\nAnswer: {c}\nScore 0-10:")
        for p, c, a in zip(prompts, completions, answer)
    ]
    assert list(scores) == expected and scores.metrics == {"failures": 0.0}
    sent = judge_server.requests[before:]
    assert len(sent) == 3
    body, headers = sent[0]["body"], sent[0]["headers"]
    assert body["model"] == "judge-1" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert headers["Authorization"] == "Bearer sk-test"
    assert sent[0]["path"] == "/v1/chat/completions"


def test_a_chunked_reply_is_read_as_well(judge_server):
    judge = LLMJudge(base_url=judge_server.url("chunked"), model="m", prompt="Rate {completion}")
    scores = judge(prompts=["p", "p"], completions=["ok", "longer"])
    assert list(scores) == [judge_score("Rate ok"), judge_score("Rate longer")]


@pytest.mark.parametrize(
    ("text", "parse", "score"),
    [
        ("Score: 7/10", "number", 7.0),
        ("from 1 to 10 I give -2.5", "last_number", -2.5),
        ("Yes, it is right.", "yes_no", 1.0),
        ("no", "yes_no", 0.0),
        ("<score>0.25</score> (of 1)", r"<score>([\d.]+)</score>", 0.25),
    ],
)
def test_read_score_by_parse(text, parse, score):
    assert read_score(text, parse) == score


@pytest.mark.parametrize("mode", ["fail", "garbage", "noscore", "hangup"])
def test_an_error_status_or_unreadable_reply_gives_the_failure_reward(judge_server, mode, caplog):
    judge = _judge(judge_server, mode, failure_reward=-1.0)
    with caplog.at_level(logging.WARNING, logger="grimoire.rollout.rewards.judge"):
        first = judge(prompts=["p", "q"], completions=["a", "b"], answer=["a", "b"])
        second = judge(prompts=["p"], completions=["a"], answer=["a"])
    assert list(first) == [-1.0, -1.0] and first.metrics == {"failures": 2.0}
    assert list(second) == [-1.0] and second.metrics == {"failures": 1.0}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and judge.url in warnings[0]  # one warning naming the endpoint


def test_a_timeout_gives_the_failure_reward_without_waiting_for_the_reply(judge_server):
    judge = _judge(judge_server, "delay/2", timeout=0.3, failure_reward=0.5)
    t0 = time.perf_counter()
    scores = judge(prompts=["p"] * 4, completions=["a"] * 4, answer=["a"] * 4)
    assert time.perf_counter() - t0 < 1.5  # concurrent requests, each cut at its timeout
    assert list(scores) == [0.5] * 4 and scores.metrics == {"failures": 4.0}


def test_a_refused_connection_gives_the_failure_reward():
    server = JudgeServer()
    url = server.url()
    server.close()  # nothing listens on that port any more
    judge = LLMJudge(base_url=url, model="m", prompt="{completion}", failure_reward=-2.0)
    assert list(judge(prompts=["p"], completions=["a"])) == [-2.0]


def test_the_judge_from_a_config_entry_and_its_failures_as_a_metric(judge_server):
    entry = {"type": "llm_judge", "args": {"base_url": judge_server.url("fail"), "model": "m"}}
    entry["args"]["prompt"] = TEMPLATE
    (rf,) = resolve_reward_funcs([entry])
    assert rf.name == "llm_judge" and rf.overlap_sampling
    assert rf.required_columns() == ["answer"]  # the template's {answer}
    assert rf.signature_problems(["other"])  # a dataset without it is refused up front
    counts: dict[str, float] = {}
    total, _ = score_completions([rf], ["p"] * 3, ["a"] * 3, {"answer": ["a"] * 3}, metrics=counts)
    assert total.tolist() == [0.0] * 3 and counts == {"rewards/llm_judge/failures": 3.0}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"prompt": "Rate this."}, "{completion}"),
        ({"base_url": "127.0.0.1:8000/v1"}, "base_url"),
        ({"timeout": 0}, "timeout"),
        ({"api_key_env": "GRIMOIRE_NO_SUCH_KEY"}, "GRIMOIRE_NO_SUCH_KEY"),
        ({"parse": "(unclosed"}, "parse"),
    ],
)
def test_bad_judge_settings_are_config_errors(args, message):
    base = {"base_url": "http://127.0.0.1:1/v1", "model": "m", "prompt": "{completion}"}
    with pytest.raises(ConfigError, match="reward_funcs\\[0\\]") as info:
        resolve_reward_funcs([{"type": "llm_judge", "args": {**base, **args}}])
    assert message in str(info.value)


# ------------------------------------------------------------------ overlap with sampling


def test_background_scoring_keeps_order_and_raises_the_first_error():
    def slow(i):
        def score():
            time.sleep(0.02 * (3 - i))  # later ones would finish first if run side by side
            return i

        return score

    with BackgroundScoring[int](True) as scoring:
        for i in range(3):
            scoring.submit(slow(i))
        assert scoring.results() == [0, 1, 2]

    def boom():
        raise RewardFunctionError("judge broke")

    for overlap in (True, False):
        with (
            pytest.raises(RewardFunctionError, match="judge broke"),
            BackgroundScoring[int](overlap) as scoring,
        ):
            scoring.submit(boom)
            scoring.results()


class SlowSampler(HFGenerateEngine):
    """The HF engine, each sampling call made ``delay`` seconds longer (a larger model) and its
    interval recorded."""

    delay = 0.3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.intervals: list[tuple[float, float]] = []

    def generate(self, *args, **kwargs):
        start = time.perf_counter()
        time.sleep(self.delay)
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.intervals.append((start, time.perf_counter()))


def _grpo(tiny_dir, tmp_path, reward, engine=None, staleness=0, steps=2):
    """GRPO on the tiny model (the async tests' run): 2 prompt micro-batches of 2 prompts per
    step, G=4; the trainer and each step's metrics."""
    trainer, log = _run(
        tiny_dir,
        tmp_path,
        staleness,
        steps=steps,
        reward=reward,
        engine=engine,
        batch_size=2,
        gradient_accumulation_steps=2,
    )
    return trainer, log.metrics


def _judge_entry(server, overlap, mode="delay/0.05", **args):
    base = {"base_url": server.url(mode), "model": "m", "prompt": TEMPLATE, "overlap": overlap}
    return {"type": "llm_judge", "args": {**base, "max_concurrency": 2, **args}}


def test_overlapped_scoring_is_observed_and_changes_no_number(judge_server, tiny_dir, tmp_path):
    runs = {}
    for overlap in (False, True):
        engine = SlowSampler(max_new_tokens=6)
        start = len(judge_server.requests)
        entry = _judge_entry(judge_server, overlap)
        trainer, metrics = _grpo(tiny_dir, tmp_path / str(overlap), entry, engine)
        assert trainer.rollouts.overlap is overlap
        arrivals = [r["time"] for r in judge_server.requests[start:]]
        # Seen from the judge: requests that arrived while the sampler was sampling.
        during = [t for t in arrivals if any(a < t < b for a, b in engine.intervals)]
        runs[overlap] = (trainer, metrics, len(arrivals), len(during))
    (plain, plain_m, plain_n, plain_during), (over, over_m, over_n, over_during) = runs.values()
    assert plain_n == over_n == 2 * 2 * 2 * 4  # steps x micro-batches x prompts x G
    assert plain_during == 0  # without overlap the judge is asked between sampling calls
    # Each step's first micro-batch (8 requests, 2 at a time) is judged while the second
    # samples (0.3 s at least); most of them arrive inside that interval.
    assert over_during >= 4
    for a, b in zip(plain_m, over_m):
        assert a["rewards/llm_judge/mean"] == b["rewards/llm_judge/mean"]
        assert a["loss"] == b["loss"] and a["rewards/llm_judge/failures"] == 0.0
    assert any(m["rewards/llm_judge/std"] > 0 for m in plain_m)  # advantages not all zero
    for p, q in zip(plain.unwrapped_model.parameters(), over.unwrapped_model.parameters()):
        assert torch.equal(p, q)


def test_a_failing_judge_trains_on_the_failure_reward_and_counts_it(
    judge_server, tiny_dir, tmp_path
):
    entry = _judge_entry(judge_server, True, "fail", failure_reward=0.0)
    _, metrics = _grpo(tiny_dir, tmp_path, entry, steps=1)
    assert metrics[0]["rewards/llm_judge/mean"] == 0.0
    assert metrics[0]["rewards/llm_judge/failures"] > 0


def raising_reward(prompts, completions, **kwargs):
    raise ValueError("the reward service is down")


raising_reward.overlap_sampling = True  # type: ignore[attr-defined]


def test_a_raising_reward_still_raises_when_overlapped(tiny_dir, tmp_path):
    with pytest.raises(RewardFunctionError, match="the reward service is down"):
        _grpo(tiny_dir, tmp_path, raising_reward, steps=1)


def test_overlap_inside_the_async_producer_matches_the_sync_step(judge_server, tiny_dir, tmp_path):
    entry = _judge_entry(judge_server, True)
    _, sync = _grpo(tiny_dir, tmp_path / "sync", entry)
    # The thread sampler: the producer thread samples itself (no child process to start), with
    # the stage's engine's copy, which shares this one's list of intervals.
    engine = SlowSampler(max_new_tokens=6, async_sampler="thread")
    start = len(judge_server.requests)
    trainer, asynchronous = _grpo(tiny_dir, tmp_path / "async", entry, engine, staleness=1)
    assert trainer.rollouts.overlap
    arrivals = [r["time"] for r in judge_server.requests[start:]]
    # The producer's 2 calls a step, 2 steps trained (and a third it may read ahead).
    assert len(arrivals) >= 32 and len(engine.intervals) >= 4
    # The producer's scoring runs beside its next sampling call, as the sync stage's does.
    assert sum(any(a < t < b for a, b in engine.intervals) for t in arrivals) >= 4
    # Step 0 is sampled by the starting weights in both runs: the same completions and scores.
    assert asynchronous[0]["rewards/llm_judge/mean"] == sync[0]["rewards/llm_judge/mean"]
    assert [m["rewards/llm_judge/failures"] for m in asynchronous] == [0.0, 0.0]


def test_episodes_judged_in_the_background_get_the_same_rewards(judge_server, tiny_dir, tmp_path):
    from tests.helpers.episodes import episode_trainer

    from grimoire.collate.prompts import GRPOCollator

    out = {}
    for overlap in (False, True):
        entry = _judge_entry(judge_server, overlap)
        trainer, rows = episode_trainer(tiny_dir, tmp_path / str(overlap), [entry])
        collate = GRPOCollator(pad_token_id=trainer.tokenizer.pad_token_id)
        micro = [(collate(rows[:2]), 1.0), (collate(rows[2:4]), 1.0)]
        torch.manual_seed(0)
        batches, metrics, _ = trainer.rollouts.step(trainer.context, micro)
        assert trainer.rollouts.overlap is overlap
        out[overlap] = ([b["advantages"] for b, _ in batches], metrics)
    (adv_a, plain), (adv_b, over) = out[False], out[True]
    assert plain["rewards/llm_judge/mean"] == over["rewards/llm_judge/mean"]
    assert plain["rewards/llm_judge/failures"] == over["rewards/llm_judge/failures"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(adv_a, adv_b))
    assert any(a.abs().sum() > 0 for a in adv_a)  # the judge's scores differ within a group
