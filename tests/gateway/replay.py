"""A loopback server replaying one recorded inference server (tests/data/recorded_routes.json): its
GETs as recorded, and on each POST route its recorded answer, whatever the request. It keeps every
request it got (path, content type, body), so tests can see what reached the node."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

RECORDED: dict[str, Any] = json.loads(
    (Path(__file__).parents[1] / "data" / "recorded_routes.json").read_text()
)


@dataclass(frozen=True)
class Seen:
    path: str
    content_type: str
    body: bytes


def recorded(server: str, route: str) -> Any:
    """A recorded answer's body: its JSON, or its bytes."""
    answer = RECORDED[server]["responses"][route]
    return (
        base64.b64decode(answer["base64"]) if "base64" in answer else answer.get("json", answer.get("text"))
    )


def replay_app(server: str) -> Starlette:
    answers: dict[str, Any] = RECORDED[server]["responses"]
    seen: list[Seen] = []

    async def answer(request: Request) -> Response:
        if request.method == "POST":
            seen.append(Seen(request.url.path, request.headers.get("content-type", ""), await request.body()))
        found = answers.get(f"{request.method} {request.url.path}")
        if found is None:
            return JSONResponse({"detail": "Not Found"}, 404)
        if "base64" in found:
            return Response(
                base64.b64decode(found["base64"]), found["status"], media_type=found["content_type"]
            )
        if "json" in found:
            return JSONResponse(found["json"], found["status"])
        return PlainTextResponse(found.get("text", ""), found["status"])

    app = Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"])])
    app.state.seen = seen
    return app
