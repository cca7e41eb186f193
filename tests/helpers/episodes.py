"""Environments, a reward, a turn sampler and a tiny-model GRPO trainer shared by the episode
tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from tests.helpers.train_utils import quiet_config

from grimoire import GrimoireTrainer
from grimoire.collate.prompts import GRPOCollator
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import reverse_rows
from grimoire.rollout.agents.environment import Step
from grimoire.rollout.engines.base import Samples
from grimoire.rollout.engines.hf import HFGenerateEngine
from grimoire.rollout.engines.vllm_server import read_frames
from grimoire.rows.prompts import tokenize_grpo


class Chatty:
    """Answers every turn with a user message; done after three turns, a reward per turn."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        return Step([{"role": "user", "content": "again"}], 0.5, self.turns == 3)


class Narrator:
    """Answers every assistant turn with a tool message (context the model did not write) and
    ends the episode after the second turn: every episode has environment tokens between two
    sampled turns, whatever the (untrained) model writes."""

    tools = None

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        if self.turns >= 2:
            return Step([], 0.0, True)
        return Step([{"role": "tool", "content": "olleh dlrow"}], 0.0, False)


class ShortTurns(HFGenerateEngine):
    """Samples from the policy, but every turn ends with the template's end token after at most
    4 sampled tokens: an untrained model rarely writes it, and a turn without it ends the
    episode. The old log-probs are still the policy's (scored after sampling)."""

    end_id = 0

    def _sample(self, prompts, n, greedy):
        rows = super()._sample(prompts, n, greedy)
        return [
            [t for t in r if t != self.end_id][: 1 + i % 4] + [self.end_id]
            for i, r in enumerate(rows)
        ]


class ScriptedFirstTurn(HFGenerateEngine):
    """Samples from the policy, but an episode's first turn (a prompt with no tool result yet)
    is ``first_turn(i)`` (``i``: the episode's place in the sampling call), so the tool is
    called whatever the untrained model writes; later turns are at most 4 of the policy's
    tokens. Every turn ends with the template's end token."""

    def __init__(self, tokenizer: Any, first_turn: Callable[[int], str], **kwargs: Any):
        super().__init__(**kwargs)
        self.tokenizer, self.first_turn = tokenizer, first_turn
        self.end_id = tokenizer.convert_tokens_to_ids("<|end|>")

    def _sample(self, prompts, n, greedy):
        rows = super()._sample(prompts, n, greedy)
        rows = rows.ids if isinstance(rows, Samples) else rows  # the sampled turns are replaced
        tok, out = self.tokenizer, []
        for i, r in enumerate(rows):
            if "result:" in tok.decode(prompts[i // n]):
                out.append([t for t in r if t != self.end_id][: 1 + i % 4] + [self.end_id])
            else:
                ids = tok(self.first_turn(i), add_special_tokens=False)["input_ids"]
                out.append(ids + [self.end_id])
        return out


def episode_trainer(
    tiny_dir, tmp_path, reward_funcs, padding_free=False, method_cls=GRPOMethod, **method_args: Any
):
    """A one-step trainer of the tiny model on 8 reverse rows, its method playing episodes of
    ``G=4`` with the tiny template's parser and end token (``method_args`` add to or replace the
    method's; the engine defaults to :class:`ShortTurns`); returns it and its rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    rows = [tokenize_grpo(r, tok, max_length=64) for r in reverse_rows(8, seed=3)]
    if "engine" not in method_args:
        method_args["engine"] = ShortTurns(max_new_tokens=8)
        method_args["engine"].end_id = tok.convert_tokens_to_ids("<|end|>")
    config = quiet_config(
        tmp_path,
        max_steps=1,
        batch_size=2,
        disable_dropout=True,
        seed=0,
        padding_free=padding_free,
    )
    settings = dict(
        num_generations=4,
        stop_tokens=["<|end|>"],
        tool_call_parser="tiny",
        max_turns=3,
        max_episode_tokens=96,
        fused=False,
    )
    method = method_cls(reward_funcs, **{**settings, **method_args})
    trainer = GrimoireTrainer(
        model=model, tokenizer=tok, config=config, loss_fn=method, train_dataset=rows
    )
    return trainer, rows


def scripted_call_trainer(
    tiny_dir, tmp_path, reward_funcs, first_turn: Callable[[int], str], **method_args: Any
):
    """:func:`episode_trainer` whose engine is a :class:`ScriptedFirstTurn` writing
    ``first_turn(i)`` (a tool call) as each episode's first turn; returns it, its rows and the
    tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    engine = ScriptedFirstTurn(tok, first_turn, max_new_tokens=32)
    trainer, rows = episode_trainer(
        tiny_dir, tmp_path, reward_funcs, engine=engine, max_episode_tokens=128, **method_args
    )
    return trainer, rows, tok


def add_call(i: int) -> str:
    """A first turn for :class:`ScriptedFirstTurn`: ``call: add(letters=a..)`` with ``1 + i % 3``
    letters, so the rewards of a tool that counts them vary in each group."""
    return f"call: add(letters={'a' * (1 + i % 3)})"


def first_call_letters(batch, tok) -> torch.Tensor:
    """The letters each episode of ``batch`` (played with :func:`add_call` first turns, the tool
    answering ``n``) passed to ``add``, as ``[2, 4]`` groups; asserts the tool's answer is read
    (attended) and never trained (mask 0) and that the rewards vary in each group."""
    letters = []
    for model_text, context_text in model_and_context_texts(tok, batch):
        n = next(k for k in (3, 2, 1) if f"call: add(letters={'a' * k})<|end|>" in model_text)
        letters.append(n)
        assert f"result: {n}" in context_text and "result:" not in model_text
    r = torch.tensor(letters, dtype=torch.float32).view(2, 4)
    assert r.std(dim=1).min() > 0, "rewards vary in each group"
    return r


def grpo_advantages(r: torch.Tensor) -> torch.Tensor:
    """GRPO's advantages of ``[groups, G]`` rewards, by hand (flattened)."""
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()


def one_episode_batch(trainer, rows):
    """The first training batch of one rollout step on the first two rows, and its metrics."""
    prompts = GRPOCollator(pad_token_id=trainer.tokenizer.pad_token_id)(rows[:2])
    batches, metrics, _ = trainer.rollouts.step(trainer.context, [(prompts, 1.0)])
    return batches[0][0], metrics


def model_and_context_texts(tok, batch) -> list[tuple[str, str]]:
    """Each row's text the model sampled (``completion_mask`` 1) and the text it only reads
    (attended after the first prompt, ``completion_mask`` 0: tool, environment and template
    tokens)."""
    mask = batch["completion_mask"]
    c = mask.shape[1]
    ids = batch["input_ids"][:, -c:]
    attended = batch["attention_mask"][:, -c:] == 1
    return [
        (
            tok.decode(ids[row][mask[row] == 1]),
            tok.decode(ids[row][attended[row] & (mask[row] == 0)]),
        )
        for row in range(ids.shape[0])
    ]


def episode_yaml(tmp_path, agent: str) -> str:
    """A one-step GRPO config of the tiny model on 4 reverse rows, written under ``tmp_path``,
    whose ``loss.args`` end with the line ``agent`` (e.g. ``"environment_factory: 'pkg:Env'"``);
    its path (a new file each call)."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "reverse ab=", "answer": "ba"}\n' * 4)
    path = tmp_path / f"run{len(list(tmp_path.glob('run*.yaml')))}.yaml"
    path.write_text(
        "model: {pretrained: 'tiny:llama'}\n"
        f"dataset: {{jsonl: {data}, tokenize: {{type: grpo}}}}\n"
        "loss:\n  type: grpo\n  args:\n"
        "    reward_funcs: [exact_match]\n    num_generations: 2\n    tool_call_parser: tiny\n"
        f"    {agent}\n"
        f"training: {{output_dir: {tmp_path / 'out'}, max_steps: 1, batch_size: 2}}\n"
    )
    return str(path)


def assert_validates(capsys, good: str, bad: str, error: str) -> None:
    """``grimoire validate`` passes the config at ``good`` and fails the one at ``bad``,
    printing ``error``."""
    from grimoire.cli.main import main

    assert main(["validate", "--config", good]) == 0
    assert "is valid" in capsys.readouterr().out
    assert main(["validate", "--config", bad]) != 0
    captured = capsys.readouterr()
    assert error in captured.out + captured.err


def answer_length(prompts, completions, **kwargs):
    """A reward that varies across a group (each answer's length), so advantages are non-zero."""
    return [float(len(c)) for c in completions]


def assert_only_model_tokens_get_gradient(trainer, policy, batch) -> None:
    """One loss and backward on ``batch``, the gradient observed at the logits that predict
    each completion position (a forward hook on the output layer): exactly zero at every
    context token (tool results, environment and template tokens: attended, not in the loss
    mask), non-zero at some of the model's own tokens. The policy's gradients are cleared."""
    mask = batch["completion_mask"]
    c = mask.shape[1]
    context = (batch["attention_mask"][:, -c:] == 1) & (mask == 0)
    seen = {}

    def keep(module, inputs, out):
        out.retain_grad()
        seen["logits"] = out

    hook = policy.get_output_embeddings().register_forward_hook(keep)
    try:
        loss, _ = trainer.loss_fn(policy, batch)
        loss.backward()
    finally:
        hook.remove()
    policy.zero_grad()
    per_token = seen["logits"].grad[:, -(c + 1) : -1].abs().sum(-1)
    assert torch.all(per_token[context] == 0), "tool/template tokens got a gradient"
    assert (per_token[mask.bool()] > 0).any()


LOGP = -0.5


class TurnSampler:
    """vLLM's side of the server: a turn is ``1 + (len(prompt) + k) % 3`` letters then the
    first stop token, ``k`` counting the copies of the same prompt in the request (the copies
    of a prompt in its group differ), each token reported at log-prob ``LOGP``; records the
    requests, the tokens it sent and the pushed weights."""

    def __init__(self, config, letters):
        self.config, self.letters, self.pushed, self.requests = config, letters, [], []
        self.sent = 0

    def info(self):
        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        return {"ok": True, "config": {k: getattr(self.config, k) for k in keys}}

    def generate(self, request):
        self.requests.append(request)
        ids, logps, seen = [], [], Counter()
        for prompt, p in zip(request["prompts"], request["params"], strict=True):
            for _ in range(p["n"]):
                k = seen[tuple(prompt)]
                seen[tuple(prompt)] += 1
                turn = self.letters[: 1 + (len(prompt) + k) % 3] + [p["stop_token_ids"][0]]
                ids.append(turn)
                logps.append([LOGP] * len(turn))
                self.sent += len(turn)
        return {"ids": ids, "logps": logps}

    def load_weights(self, stream):
        self.pushed.append(dict(read_frames(stream)))
        return {"ok": True}
