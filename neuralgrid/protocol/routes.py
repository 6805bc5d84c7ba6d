"""The OpenAI routes a node may serve, named as the path after /v1/ (what agents report, what the
matcher filters on: nodes.routes in SQL lists the same names)."""

from __future__ import annotations

from typing import Literal, get_args

Route = Literal[
    "chat/completions",
    "completions",
    "embeddings",
    "responses",
    "rerank",
    "score",
    "audio/transcriptions",
    "audio/translations",
    "audio/speech",
]
ROUTES: tuple[Route, ...] = get_args(Route)
# What every node served before nodes reported their routes (and what one that does not say serves).
DEFAULT_ROUTES: tuple[Route, ...] = ("chat/completions", "completions", "embeddings")
# Not a path: a completion that echoes its prompt (`echo: true`), which some servers ignore
# (llama-server). A node serves it when its agent verified that its server echoes (backend.echoes;
# derived in SQL, never listed by an agent), and the matcher sends echo requests only to those.
ECHO = "completions+echo"
# What the matcher filters on (nodes.routes in SQL may hold exactly these).
MATCHED: tuple[str, ...] = (*ROUTES, ECHO)


def path(route: Route) -> str:
    return "/v1/" + route


def route_of(path_: str) -> Route | None:
    """The route a /v1/... path names, or None when it names none."""
    name = path_.removeprefix("/v1/")
    return next((route for route in ROUTES if route == name), None) if path_.startswith("/v1/") else None


def parse_routes(text: str) -> tuple[Route, ...]:
    """A comma-separated list of routes (`responses,rerank` or `/v1/responses,/v1/rerank`), in the
    order given, each once; ValueError naming the first one that is no known route."""
    routes: list[Route] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        route = route_of(part if part.startswith("/v1/") else "/v1/" + part.lstrip("/"))
        if route is None:
            raise ValueError(f"{part!r} is not a route a node can serve; known: {', '.join(ROUTES)}")
        if route not in routes:
            routes.append(route)
    if not routes:
        raise ValueError("name at least one route")
    return tuple(routes)


def root_url(url: str) -> str:
    """A server's root from the URL an owner gives: OpenAI clients are configured with base URLs that
    end in /v1 (http://host:8000/v1), and an owner may paste one; the paths we add start with /v1."""
    url = url.strip().rstrip("/")
    return url.removesuffix("/v1") if url.endswith("/v1") else url
