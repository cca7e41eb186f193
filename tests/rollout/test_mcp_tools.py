"""Tools served by MCP servers (``loss.args.mcp_servers``): listed from a stdio server and a
streamable HTTP server that the tests start (``tests/helpers/mcp_server.py``, the ``mcp`` SDK's
FastMCP), their schemas handed to the chat template, calls routed to the server and answered,
errors (a raising tool, bad arguments, a server that dies mid-call, a slow one) turned into tool
messages, the config checked up front, and a GRPO step on episodes that call a server's tool
trains only the model's own tokens.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.helpers.commands import ROOT
from tests.helpers.episodes import (
    ScriptedFirstTurn,
    answer_length,
    assert_only_model_tokens_get_gradient,
    episode_trainer,
    episode_yaml,
    model_and_context_texts,
    one_episode_batch,
    scripted_call_trainer,
)
from tests.helpers.train_utils import free_port

from grimoire.cli.main import main
from grimoire.errors import ConfigError
from grimoire.losses.grpo import GRPOMethod
from grimoire.model.tiny import build_tokenizer, lookup
from grimoire.rollout.agents.environment import ToolEnvironment
from grimoire.rollout.agents.mcp_tools import connect_mcp_tools, parse_mcp_servers

SERVER = str(ROOT / "tests" / "helpers" / "mcp_server.py")
STDIO = {"command": [sys.executable, SERVER]}

#: The server's tools as the chat template gets them, written out by hand from the tool
#: functions of mcp_server.py (FastMCP's pydantic schemas: a title per property and object).
EXPECTED = {
    "lookup": {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The reverse of a word.",
            "parameters": {
                "type": "object",
                "title": "lookupArguments",
                "properties": {
                    "word": {
                        "type": "string",
                        "title": "Word",
                        "description": "the word to look up",
                    }
                },
                "required": ["word"],
            },
        },
    },
    "add": {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "title": "addArguments",
                "properties": {
                    "a": {"type": "integer", "title": "A"},
                    "b": {"type": "integer", "title": "B", "default": 1},
                },
                "required": ["a"],
            },
        },
    },
}


def wait_for_port(port: int, process: subprocess.Popen, deadline_s: float = 20.0) -> None:
    """Until ``port`` accepts a connection; fails if the process exits or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the MCP server exited at start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"the MCP server did not listen on {port} within {deadline_s}s")


def start_http_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, SERVER, "--port", str(port)])
    try:
        wait_for_port(port, process)
    except BaseException:
        stop(process)
        raise
    return process, f"http://127.0.0.1:{port}/mcp"


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def http_url():
    process, url = start_http_server()
    try:
        yield url
    finally:
        stop(process)


@pytest.fixture(scope="module")
def stdio_toolset():
    toolset = connect_mcp_tools(parse_mcp_servers([STDIO]))
    try:
        yield toolset
    finally:
        toolset.close()


def call(env: ToolEnvironment, name: str, **arguments):
    return env.call({"function": {"name": name, "arguments": arguments}})


def test_mcp_stdio_tools_are_listed_with_the_servers_schemas(stdio_toolset):
    tools = {t.name: t for t in stdio_toolset.tools}
    assert list(tools) == ["lookup", "add", "fail", "nap", "crash"]
    assert tools["lookup"].schema == EXPECTED["lookup"]
    assert tools["add"].schema == EXPECTED["add"]
    # What the chat template is given: ToolEnvironment.tools, rendered by the tiny template.
    env = ToolEnvironment(stdio_toolset.tools)
    assert env.tools[:2] == [EXPECTED["lookup"], EXPECTED["add"]]
    text = build_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=env.tools, tokenize=False
    )
    assert text.startswith("<bos><|system|>tools: lookup add fail nap crash<|end|>"), text


def test_mcp_stdio_calls_reach_the_server_and_errors_are_tool_messages(stdio_toolset):
    env = ToolEnvironment(stdio_toolset.tools, timeout=5.0)
    assert call(env, "lookup", word="abcdef").content == "fedcba"
    assert call(env, "add", a=2).content == "3"  # the server's default b=1
    assert call(env, "add", a=2, b=40).content == "42"
    raised = call(env, "fail", message="boom")
    assert raised.outcome == "exception"
    assert raised.content == "error: McpToolError: Error executing tool fail: boom"
    # Checked against the schema before it is sent: a missing or unknown argument.
    missing = call(env, "add", b=2)
    assert missing.content == "error: bad arguments for add: missing a required argument: 'a'"
    assert call(env, "lookup", wrd="x").outcome == "bad_arguments"
    # A value of the wrong type: the server's validation error, as a tool message.
    typed = call(env, "lookup", word=3)
    assert typed.content.startswith("error: McpToolError: Error executing tool lookup: 1 valid")
    assert call(env, "search").outcome == "unknown_tool"
    assert env.counters == {
        "tools/calls": 8,
        "tools/ok": 3,
        "tools/exception": 2,
        "tools/bad_arguments": 2,
        "tools/unknown_tool": 1,
    }


def test_mcp_calls_from_many_threads_at_once(stdio_toolset):
    # Episodes call tools from the learner's thread, an asynchronous rollout producer's and each
    # call's own timeout thread: one bridge serves them all at once.
    lookup_tool = next(t for t in stdio_toolset.tools if t.name == "lookup")
    words = [f"word{i}x" for i in range(32)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda w: lookup_tool.function(word=w), words))
    assert answers == [w[::-1] for w in words]


def test_mcp_stdio_server_that_dies_mid_call_is_an_error_message_then_restarted(stdio_toolset):
    env = ToolEnvironment(stdio_toolset.tools, timeout=5.0)
    start = time.monotonic()
    died = call(env, "crash")
    assert time.monotonic() - start < 4.0, "the caller waited for the dead server"
    assert died.outcome == "exception"
    assert died.content.startswith("error: McpServerError: MCP server ") and (
        died.content.endswith("McpError: Connection closed")
    )
    # The next call starts the server again.
    assert call(env, "lookup", word="abc").content == "cba"


def test_mcp_slow_tool_times_out_as_a_tool_message(stdio_toolset):
    env = ToolEnvironment(stdio_toolset.tools, timeout=0.3)
    start = time.monotonic()
    slow = call(env, "nap", seconds=0.8)
    assert time.monotonic() - start < 0.7
    assert (slow.outcome, slow.content) == ("timeout", "error: nap did not finish within 0.3s")


def test_mcp_http_tools_are_listed_and_called(http_url):
    toolset = connect_mcp_tools(parse_mcp_servers([{"url": http_url, "tools": ["add", "fail"]}]))
    try:
        assert [t.schema for t in toolset.tools][:1] == [EXPECTED["add"]]
        assert [t.name for t in toolset.tools] == ["add", "fail"]  # the 'tools' filter
        env = ToolEnvironment(toolset.tools, timeout=5.0)
        assert call(env, "add", a=1, b=2).content == "3"
        assert call(env, "fail", message="no").content == (
            "error: McpToolError: Error executing tool fail: no"
        )
        assert call(env, "lookup", word="x").outcome == "unknown_tool"  # not taken
    finally:
        toolset.close()


def test_mcp_http_server_killed_mid_run_gives_error_messages_not_a_hang():
    process, url = start_http_server()
    try:
        toolset = connect_mcp_tools(parse_mcp_servers([{"url": url, "tools": ["lookup"]}]))
        env = ToolEnvironment(toolset.tools, timeout=1.0)
        assert call(env, "lookup", word="ab").content == "ba"
    finally:
        stop(process)
    try:
        start = time.monotonic()
        after = [call(env, "lookup", word="ab") for _ in range(3)]
        assert time.monotonic() - start < 3 * 1.0 + 1.0
        assert all(r.content.startswith("error: ") for r in after), after
        assert all(r.outcome in ("exception", "timeout") for r in after), after
    finally:
        toolset.close()


def test_mcp_servers_config_errors_name_the_key(tmp_path):
    bad = [
        {"command": ["python", SERVER], "url": "http://127.0.0.1:1/mcp"},
        {"url": "ftp://x", "args": ["a"]},
        {"command": []},
        {"command": "python", "env": {"A": 1}, "tools": [], "port": 3},
        "python server.py",
    ]
    with pytest.raises(ConfigError) as caught:
        GRPOMethod(["exact_match"], num_generations=2, mcp_servers=bad)
    assert caught.value.problems == [
        "loss.args.mcp_servers[0]: give 'command' (a stdio server) or 'url' (HTTP), one of them",
        "loss.args.mcp_servers[1].args: only for a stdio server ('command')",
        "loss.args.mcp_servers[1].url: an http:// or https:// URL, got 'ftp://x'",
        "loss.args.mcp_servers[2].command: a program and its arguments, got []",
        "loss.args.mcp_servers[3].port: unknown key (keys: ['args', 'command', 'cwd', 'env', "
        "'headers', 'name', 'tools', 'url'])",
        "loss.args.mcp_servers[3].env: a mapping of names to strings, got {'A': 1}",
        "loss.args.mcp_servers[3].tools: a non-empty list of tool names, got []",
        "loss.args.mcp_servers[4]: a mapping with 'command' (stdio) or 'url' (HTTP), "
        "got 'python server.py'",
    ]
    # Servers that do not start or answer, a tool the server lacks, a name used twice: one
    # error, at build time (before any model), naming each server.
    dead_port = free_port()
    with pytest.raises(ConfigError) as caught:
        GRPOMethod(
            ["exact_match"],
            num_generations=2,
            tools=[lookup],
            mcp_servers=[
                {"command": ["python", str(tmp_path / "missing.py")], "name": "gone"},
                {"url": f"http://127.0.0.1:{dead_port}/mcp"},
                {"command": ["python", SERVER], "tools": ["lookup", "search"]},
            ],
        )
    problems = caught.value.problems
    assert len(problems) == 4, problems
    assert problems[0].startswith("loss.args.mcp_servers[0]: cannot list its tools: MCP server")
    assert "'gone'" in problems[0]
    assert problems[1].startswith("loss.args.mcp_servers[1]: cannot list its tools: MCP server")
    assert "ConnectError" in problems[1]
    assert problems[2].startswith("loss.args.mcp_servers[2].tools: server ") and (
        "has no tool ['search'] (tools: lookup, add, fail, nap, crash)" in problems[2]
    )
    assert problems[3] == (
        "loss.args.mcp_servers[2]: tool 'lookup' is also in loss.args.tools; names must differ "
        "(take a subset with 'tools')"
    )
    with pytest.raises(ConfigError, match=r"mcp_servers: offered by the default tool environ"):
        GRPOMethod(
            ["exact_match"], num_generations=2, environment=ToolEnvironment, mcp_servers=[STDIO]
        )


def test_mcp_servers_beside_openenv_or_verifiers_are_refused_without_starting_them(tmp_path):
    """openenv and verifiers bring their own tools: one named error, and the stdio server is
    never started (it would write its marker file)."""
    marker = tmp_path / "started"
    server = {"command": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}
    others = {
        "openenv": ({"base_url": "http://127.0.0.1:9"}, "loss.args: give openenv or mcp_servers"),
        "verifiers": ("no_such_module:load_environment", "give verifiers or mcp_servers"),
    }
    for key, (value, error) in others.items():
        with pytest.raises(ConfigError) as info:
            GRPOMethod(["exact_match"], num_generations=2, mcp_servers=[server], **{key: value})
        assert any(error in p for p in info.value.problems), info.value.problems
    assert not marker.exists()


def test_mcp_missing_extra_is_one_error_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ConfigError) as caught:
        GRPOMethod(["exact_match"], num_generations=2, mcp_servers=[STDIO])
    (problem,) = caught.value.problems
    assert problem.startswith(
        "loss.args.mcp_servers: MCP tool servers need the MCP client: pip install 'grimoire[mcp]'"
    )


def test_mcp_yaml_validates_and_a_bad_server_fails_validation(tmp_path, capsys):
    def config(server: str) -> str:
        return episode_yaml(tmp_path, f"mcp_servers: [{server}]")

    assert main(["validate", "--config", config(f"{{command: [python, '{SERVER}']}}")]) == 0
    assert "is valid" in capsys.readouterr().out
    assert main(["validate", "--config", config("{command: [python], url: 'http://x'}")]) != 0
    captured = capsys.readouterr()
    assert "mcp_servers[0]: give 'command'" in captured.out + captured.err


def test_mcp_grpo_step_trains_only_model_tokens(tiny_dir, tmp_path):
    words = ["ab", "abc", "abcd"]
    # Each episode's first turn calls the server's lookup: its answer is the tool message.
    trainer, rows, tok = scripted_call_trainer(
        tiny_dir,
        tmp_path,
        [answer_length],
        lambda i: f"call: lookup(word={words[i % 3]})",
        mcp_servers=[{"command": ["python", SERVER], "tools": ["lookup"]}],
    )
    try:
        batch, metrics = one_episode_batch(trainer, rows)
        assert metrics["tools/calls"] == 8.0 and metrics["tools/ok"] == 8.0
        assert metrics["episode/turns_mean"] == 2.0
        prompt_width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
        texts = model_and_context_texts(tok, batch)
        for row, (model_text, context_text) in enumerate(texts):
            # The server's tool is in the prompt the chat template wrote.
            prompt = tok.decode(batch["input_ids"][row][:prompt_width])
            assert "<|system|>tools: lookup<|end|>" in prompt
            word = next(w for w in reversed(words) if f"call: lookup(word={w})" in model_text)
            # The server's answer is read (attended), never trained (mask 0).
            assert f"result: {word[::-1]}<|end|>" in context_text
            assert "result:" not in model_text
        assert batch["advantages"].abs().sum() > 0
        assert_only_model_tokens_get_gradient(trainer, trainer.context.unwrapped_model, batch)
    finally:
        trainer.close()
    # The trainer's close closed the sessions (and the loop that held them).
    assert not trainer.rollouts.agent.resources[0].bridge.running


def test_mcp_tools_in_asynchronous_rollouts(tiny_dir, tmp_path):
    # max_staleness=1: the episodes (and their tool calls) are played by the producer thread.
    tok = build_tokenizer()
    engine = ScriptedFirstTurn(
        tok, lambda i: "call: lookup(word=abc)", max_new_tokens=32, async_sampler="thread"
    )
    trainer, _ = episode_trainer(
        tiny_dir,
        tmp_path,
        [answer_length],
        engine=engine,
        max_staleness=1,
        max_episode_tokens=128,
        mcp_servers=[{"command": ["python", SERVER], "tools": ["lookup"]}],
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tools/calls" in r]
    assert steps and all(r["tools/ok"] == r["tools/calls"] == 8 for r in steps), records
