"""A stand-in LLM judge: an OpenAI-compatible ``/v1/chat/completions`` server on loopback.

The reply to a request is ``"Score: <n>"`` with ``n`` the length of its last message's text, so
a test computes every expected score by hand. The path before ``/v1`` picks a behaviour:

- ``/v1``: answer at once; ``/delay/<seconds>/v1``: answer after that long;
- ``/fail/v1``: HTTP 500; ``/garbage/v1``: 200 with a body that is not JSON;
- ``/noscore/v1``: a well-formed completion whose text holds no number;
- ``/hangup/v1``: a reply cut off mid-body (the connection closed);
- ``/chunked/v1``: the answer in ``Transfer-Encoding: chunked`` (as some servers stream it).

Every request is recorded (:attr:`JudgeServer.requests`: arrival time, path, body), for tests
that observe when the judge was asked.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def judge_score(text: str) -> float:
    """The stand-in judge's score of a message (its length)."""
    return float(len(text))


def mode_url(root: str, mode: str) -> str:
    """The ``base_url`` of a behaviour ``mode`` of the judge at ``root`` (``http://h:p/v1``)."""
    prefix = f"/{mode.strip('/')}" if mode else ""
    return root.removesuffix("/v1") + prefix + "/v1"


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        arrived = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(
                {"time": arrived, "path": self.path, "body": body, "headers": dict(self.headers)}
            )
        mode, _, rest = self.path.strip("/").partition("/")
        if mode == "delay":
            time.sleep(float(rest.split("/")[0]))
        if mode == "fail":
            self._send(500, b'{"error": "overloaded"}')
        elif mode == "hangup":
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n{")
            self.close_connection = True
        elif mode == "garbage":
            self._send(200, b"<html>not a chat completion</html>")
        else:
            text = "I cannot tell" if mode == "noscore" else None
            text = text or f"Score: {judge_score(body['messages'][-1]['content']):g}"
            reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
            self._send(200, json.dumps(reply).encode(), chunked=mode == "chunked")

    def _send(self, status: int, payload: bytes, chunked: bool = False) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if chunked:  # two chunks, then the empty one
                self.send_header("Transfer-Encoding", "chunked")
                half = len(payload) // 2
                parts = [payload[:half], payload[half:], b""]
                payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
            else:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:  # the client gave up (its timeout): nothing to answer
            pass

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a whole micro-batch of requests connects at once
    requests: list[dict[str, Any]]
    lock: threading.Lock


class JudgeServer:
    """The stand-in judge serving in a thread; :meth:`close` stops it. ``url(mode)`` is the
    ``base_url`` of a behaviour (module docstring)."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.requests, self._server.lock = [], threading.Lock()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self._server.requests

    def url(self, mode: str = "") -> str:
        host, port = self._server.server_address[:2]
        return mode_url(f"http://{host}:{port}/v1", mode)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def main() -> None:
    """Serve in this process until killed, the first line of stdout its root URL (the
    benchmark's judge runs apart, as a real one does, not sharing the trainer's GIL)."""
    server = JudgeServer()
    print(server.url(), flush=True)
    try:
        threading.Event().wait()
    finally:
        server.close()


if __name__ == "__main__":
    main()
