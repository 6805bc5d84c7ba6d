"""The referee: a small HTTP process that holds the trusted reference models and scores answers.

    python -m neuralgrid.verify.referee --model PATH [--model PATH ...] [--host H] --port N

Run by the Python of llama-cpp-python's venv (scripts/backends.sh builds one) with the repository on
PYTHONPATH: it needs the standard library, numpy and llama_cpp, nothing else of the project's.

    GET  /v1/artifacts  {"artifacts": [{"sha256": ..., "path": ...}]}
    POST /v1/score      {"sha256": ..., "messages": [...], "answer": "...", "finish_reason": "stop"|"length"}
                        (or "answer_ids": [...], the node's own token ids, in place of "answer")
                     -> {"gaps": [...], "prompt_tokens": n, "answer_tokens": m, "cpu_s": x}

Errors answer 4xx with {"error": {"message": ...}}. Requests are served on threads, but scored one at
a time under a lock: llama_cpp is not thread-safe, and the CPU is the limit anyway.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from neuralgrid.verify.reference import DEFAULT_CTX, PromptTooLong, Reference, Scored, ScoreError

MAX_BODY = 1 << 20  # a challenge is a few KB; more is a mistake or an attack
FINISH_REASONS = ("stop", "length")
ROLES = ("system", "user", "assistant")


class BadRequest(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class Referee:
    """The references by their file's sha256, and the lock that serializes scoring."""

    def __init__(self, references: list[Reference]) -> None:
        self.references = {r.sha256: r for r in references}
        self.lock = threading.Lock()

    def artifacts(self) -> dict[str, Any]:
        return {"artifacts": [{"sha256": r.sha256, "path": str(r.path)} for r in self.references.values()]}

    def score(self, body: Any) -> Scored:
        if not isinstance(body, dict):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        sha256 = body.get("sha256")
        reference = self.references.get(sha256) if isinstance(sha256, str) else None
        if reference is None:
            raise BadRequest(HTTPStatus.NOT_FOUND, "unknown sha256: GET /v1/artifacts lists the models")
        messages = _messages(body.get("messages"))
        finish = body.get("finish_reason")
        if finish not in FINISH_REASONS:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"finish_reason must be one of {list(FINISH_REASONS)}")
        answer = _answer(body)
        try:
            prompt = reference.render(messages)
        except Exception as e:  # the template's own: its raise_exception(), jinja2's errors
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"cannot render the messages: {e}") from e
        stopped = finish == "stop"
        with self.lock:
            try:
                if isinstance(answer, str):
                    return reference.score(prompt, answer, stopped)
                return reference.score_ids(prompt, answer, stopped)
            except PromptTooLong as e:
                raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(e)) from e
            except ScoreError as e:
                raise BadRequest(HTTPStatus.BAD_REQUEST, str(e)) from e


def _answer(body: dict[str, Any]) -> str | list[int]:
    """The node's answer: its text, or its own token ids where the caller has them (no retokenizing)."""
    text, ids = body.get("answer"), body.get("answer_ids")
    if (text is None) == (ids is None):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "give either answer (a string) or answer_ids")
    if isinstance(text, str):
        return text
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return ids
    raise BadRequest(HTTPStatus.BAD_REQUEST, "answer must be a string, answer_ids a list of integers")


def _messages(value: Any) -> list[dict[str, str]]:
    """Plain chat messages: a role and a string content each (what a challenge sends)."""
    if not isinstance(value, list) or not value:
        raise BadRequest(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list")
    for m in value:
        if not (isinstance(m, Mapping) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, f"each message needs a role of {list(ROLES)} and a string content"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


class Handler(BaseHTTPRequestHandler):
    referee: Referee  # set on the class made for each server
    protocol_version = "HTTP/1.1"  # keep-alive: a caller scores many answers in a row

    def do_GET(self) -> None:
        if self.path == "/v1/artifacts":
            self._send(HTTPStatus.OK, self.referee.artifacts())
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route GET {self.path}")

    def do_POST(self) -> None:
        if self.path != "/v1/score":
            self._drain()
            self._error(HTTPStatus.NOT_FOUND, f"no route POST {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length") or "")
        except ValueError:
            self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required", close=True)
            return
        if not 0 <= length <= MAX_BODY:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body exceeds {MAX_BODY} bytes", close=True)
            return
        try:
            body = json.loads(self.rfile.read(length))
        except (ValueError, UnicodeDecodeError):
            self._error(HTTPStatus.BAD_REQUEST, "the body is not JSON")
            return
        try:
            scored = self.referee.score(body)
        except BadRequest as e:
            self._error(e.status, str(e))
            return
        self._send(
            HTTPStatus.OK,
            {
                "gaps": scored.gaps,
                "prompt_tokens": scored.prompt_tokens,
                "answer_tokens": scored.answer_tokens,
                "cpu_s": scored.cpu_s,
            },
        )

    def _drain(self) -> None:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= MAX_BODY:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _error(self, status: HTTPStatus, message: str, *, close: bool = False) -> None:
        self.close_connection = self.close_connection or close
        self._send(status, {"error": {"message": message}})

    def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the scores; errors answer the caller


def serve(referee: Referee, host: str, port: int) -> ThreadingHTTPServer:
    """A server bound to (host, port), not yet serving (call serve_forever)."""
    handler = type("RefereeHandler", (Handler,), {"referee": referee})
    return ThreadingHTTPServer((host, port), handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m neuralgrid.verify.referee", description=__doc__)
    parser.add_argument("--model", action="append", required=True, type=Path, help="a GGUF file (repeat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="tokens of prompt and answer at most")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: all CPUs)")
    args = parser.parse_args(argv)
    referee = Referee([Reference(path, n_ctx=args.ctx, n_threads=args.threads) for path in args.model])
    server = serve(referee, args.host, args.port)
    for sha256, reference in referee.references.items():
        print(f"referee: {sha256} {reference.path}", file=sys.stderr)
    print(f"referee: listening on http://{args.host}:{server.server_address[1]}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
