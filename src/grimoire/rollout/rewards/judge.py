"""``llm_judge``: an LLM behind an OpenAI-compatible HTTP endpoint as a reward function.

Each completion is one ``POST {base_url}/chat/completions`` request (``base_url`` as the OpenAI
client takes it, e.g. ``http://127.0.0.1:8000/v1``; vLLM's, SGLang's and llama.cpp's servers
answer it) whose user message is ``prompt`` formatted with ``{prompt}``, ``{completion}`` and
any dataset column it names (``{answer}``: the column becomes required, checked before
training). The score is read from the reply's text by ``parse``.

The requests of one call run concurrently (at most ``max_concurrency`` at once) on one asyncio
event loop, each given ``timeout`` seconds in all (connecting, sending, the whole reply). One
thread, not one per request: the stage scores beside the sampler (below), whose Python loop
holds the GIL, and every thread waking for a reply waits its turn for it (64 threaded requests
took 0.76 s beside a busy Python thread, 0.44 s on one event loop, against 0.3 s of judge time).
The HTTP/1.1 client is the few lines of :func:`post_json` (the standard library's streams and
``ssl``, so no HTTP package is needed; it connects directly: no proxy, no redirects). A timeout, a refused connection, an HTTP error status, a reply that is not a chat
completion or whose text holds no score gives that completion ``failure_reward``: the judge
never raises or hangs on the endpoint's behalf. The call's failures come back with its rewards
(:class:`~grimoire.rollout.rewards.calls.RewardBatch`) and are logged as
``rewards/<name>/failures`` (summed over the step); the first failure is also one warning that
names the endpoint and the reason.

A judge is slow (a request is a generation on another server), so it declares
``overlap_sampling``: the rollout stage scores a prompt micro-batch's completions in a
background thread while the next micro-batch samples (:mod:`grimoire.rollout.rewards.background`).
Its calls are thread-safe (no state but the one-warning flag, under a lock).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import ssl
import string
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import SplitResult, urlsplit

from grimoire.rollout.rewards.calls import RewardBatch

logger = logging.getLogger(__name__)

#: ``parse`` short names; any other value is a regular expression whose first group is the score.
PARSERS = {
    "number": r"(-?\d+(?:\.\d+)?)",  # the first number in the reply
    "last_number": r"(?s:.*)(?<![\d.-])(-?\d+(?:\.\d+)?)",
    "yes_no": r"^\W*(yes|no)\b",  # 1.0 for yes, 0.0 for no (case-insensitive)
}
#: The template fields every call fills; any other field is a dataset column.
FILLED = ("prompt", "completion")
#: What a failed request raised: the endpoint's problems (a timeout, a connection error, a reply
#: that is not JSON or not shaped as a chat completion), never an error of the trainer's own.
ENDPOINT_ERRORS = (
    OSError,
    EOFError,  # asyncio.IncompleteReadError: the server closed mid-reply
    asyncio.LimitOverrunError,  # headers past the stream's 64 KiB limit
    asyncio.TimeoutError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
)
T = TypeVar("T")


class JudgeFailure(Exception):
    """One request gave no score (the reason is the message)."""


def template_fields(template: str) -> list[str]:
    """The named fields of a ``str.format`` template (a ValueError for positional ones)."""
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    bad = [f for f in fields if not f.isidentifier()]
    if bad:
        raise ValueError(f"prompt: template fields must be names like {{completion}}, got {bad}")
    return list(dict.fromkeys(fields))


def read_score(text: str, parse: str) -> float:
    """The score in a reply's ``text`` by ``parse`` (a :data:`PARSERS` name or a regex whose first
    group is the number); a :class:`JudgeFailure` when there is none."""
    pattern = PARSERS.get(parse, parse)
    match = re.search(pattern, text, flags=re.IGNORECASE)
    if match is None:
        raise JudgeFailure(f"no score in the reply {text[:80]!r} (parse: {parse!r})")
    found = match.group(1) if match.groups() else match.group(0)
    if parse == "yes_no":
        return 1.0 if found.lower() == "yes" else 0.0
    try:
        value = float(found)
    except ValueError:
        raise JudgeFailure(f"{found!r} in the reply is not a number (parse: {parse!r})") from None
    if not math.isfinite(value):
        raise JudgeFailure(f"the reply's score {found!r} is not finite")
    return value


async def read_body(reader: asyncio.StreamReader, fields: Mapping[str, str]) -> bytes:
    """A reply's body after its headers (``fields``, lower-cased): ``Content-Length`` bytes, the
    chunks of ``Transfer-Encoding: chunked``, else all until the server closes."""
    if fields.get("transfer-encoding") == "chunked":
        out = bytearray()
        while size := int((await reader.readline()).split(b";")[0].strip(), 16):
            out += (await reader.readexactly(size + 2))[:-2]  # each chunk ends with CRLF
        return bytes(out)
    if "content-length" in fields:
        return await reader.readexactly(int(fields["content-length"]))
    return await reader.read()


async def post_json(
    url: SplitResult, body: bytes, headers: Mapping[str, str], tls: ssl.SSLContext | None
) -> Any:
    """``POST`` JSON ``body`` to ``url`` on a connection of its own (closed after) and return the
    reply's JSON; a :class:`JudgeFailure` for a status that is not 2xx."""
    port = url.port or (443 if url.scheme == "https" else 80)
    reader, writer = await asyncio.open_connection(url.hostname, port, ssl=tls)
    try:
        lines = [f"POST {url.path or '/'} HTTP/1.1", f"Host: {url.netloc}", "Connection: close"]
        lines += [f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *header_lines = head.strip().split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise JudgeFailure(f"not an HTTP reply: {status_line[:80]!r}")
        pairs = (h.partition(":") for h in header_lines)
        payload = await read_body(
            reader, {k.strip().lower(): v.strip().lower() for k, _, v in pairs}
        )
    finally:
        writer.close()
    if not parts[1].startswith("2"):
        raise JudgeFailure(f"HTTP {parts[1]}: {payload[:120]!r}")
    return json.loads(payload)


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on a new event loop: here, or on a thread of its own when this
    thread already runs one (a notebook's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class LLMJudge:
    """``llm_judge``: each completion scored by an LLM over HTTP (see the module docstring).

    Args:
        base_url: the OpenAI-compatible API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the ``model`` field of every request.
        prompt: the user message, a ``str.format`` template with ``{completion}`` and optionally
            ``{prompt}`` and dataset columns (``{answer}``).
        system: an optional system message.
        api_key_env: the environment variable holding a bearer token (read once, here).
        timeout: seconds one request may take in all (its wait for a free slot not counted).
        failure_reward: the reward of a completion the judge gave no score for.
        max_concurrency: requests in flight at once within a call.
        parse: how the score is read: ``number`` (the first), ``last_number``, ``yes_no``, or a
            regular expression whose first group is the number.
        max_tokens, temperature: the requests' sampling settings (greedy by default).
        overlap: score in the background while the next micro-batch samples.
    """

    __name__ = "llm_judge"

    def __init__(
        self,
        base_url: str,
        model: str,
        prompt: str,
        *,
        system: str | None = None,
        api_key_env: str | None = None,
        timeout: float = 30.0,
        failure_reward: float = 0.0,
        max_concurrency: int = 8,
        parse: str = "number",
        max_tokens: int = 16,
        temperature: float = 0.0,
        overlap: bool = True,
    ):
        if not str(base_url).startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected http(s)://host:port/v1, got {base_url!r}")
        fields = template_fields(prompt)
        if "completion" not in fields:
            raise ValueError("prompt: the template must show the judge the {completion}")
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        if not (isinstance(max_concurrency, int) and max_concurrency >= 1):
            raise ValueError(f"max_concurrency: expected an int >= 1, got {max_concurrency!r}")
        if not math.isfinite(failure_reward):
            raise ValueError(f"failure_reward: expected a finite number, got {failure_reward!r}")
        if parse not in PARSERS:
            try:
                re.compile(parse)
            except re.error as exc:
                raise ValueError(f"parse: {parse!r} is no short name nor a regex ({exc})") from None
        self.headers = {"Content-Type": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"api_key_env: the environment variable {api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self.url = str(base_url).rstrip("/") + "/chat/completions"
        self._split = urlsplit(self.url)
        self._tls = ssl.create_default_context() if self._split.scheme == "https" else None
        self.model, self.prompt, self.system = model, prompt, system
        self.timeout, self.failure_reward = float(timeout), float(failure_reward)
        self.max_concurrency, self.parse = max_concurrency, parse
        self.max_tokens, self.temperature = max_tokens, temperature
        self.overlap_sampling = bool(overlap)
        self.required_columns = tuple(f for f in fields if f not in FILLED)
        self._warned = False
        self._lock = threading.Lock()

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> RewardBatch:
        """One score per completion (``failure_reward`` where the request failed)."""
        messages = [
            self.prompt.format(
                prompt=p, completion=c, **{k: columns[k][i] for k in self.required_columns}
            )
            for i, (p, c) in enumerate(zip(prompts, completions))
        ]
        if not messages:
            return RewardBatch([], {"failures": 0.0})
        outcomes = run_coroutine(self._ask_all(messages))
        failures = [why for _, why in outcomes if why is not None]
        if failures:
            self._warn_once(f"{failures[0]} ({len(failures)} of {len(messages)} in this call)")
        return RewardBatch([score for score, _ in outcomes], {"failures": float(len(failures))})

    async def _ask_all(self, messages: list[str]) -> list[tuple[float, str | None]]:
        slots = asyncio.Semaphore(self.max_concurrency)

        async def ask(message: str) -> tuple[float, str | None]:
            async with slots:
                return await self._ask(message)

        return list(await asyncio.gather(*(ask(m) for m in messages)))

    async def _ask(self, message: str) -> tuple[float, str | None]:
        """``(score, None)``, or ``(failure_reward, why)`` when the endpoint gave no score."""
        try:
            text = await asyncio.wait_for(self.reply(message), self.timeout)
            return read_score(text, self.parse), None
        except asyncio.TimeoutError:
            return self.failure_reward, f"no reply within timeout={self.timeout} s"
        except (JudgeFailure, *ENDPOINT_ERRORS) as exc:
            return self.failure_reward, f"{type(exc).__name__}: {exc}"

    async def reply(self, message: str) -> str:
        """The judge's answer text to one user ``message`` (raises on any endpoint problem)."""
        turns = [{"role": "user", "content": message}]
        if self.system is not None:
            turns.insert(0, {"role": "system", "content": self.system})
        body = {
            "model": self.model,
            "messages": turns,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        data = await post_json(self._split, json.dumps(body).encode(), self.headers, self._tls)
        text = data["choices"][0]["message"]["content"]
        if not isinstance(text, str):
            raise JudgeFailure(f"the reply's content is {type(text).__name__}, not text")
        return text

    def _warn_once(self, why: str) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        logger.warning(
            "llm_judge at %s gave no score: %s; those completions get failure_reward=%s "
            "(counted in rewards/<name>/failures; this warning is not repeated)",
            self.url,
            why,
            self.failure_reward,
        )


__all__ = [
    "PARSERS",
    "JudgeFailure",
    "LLMJudge",
    "post_json",
    "read_body",
    "read_score",
    "run_coroutine",
    "template_fields",
]
