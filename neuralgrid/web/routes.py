"""The web UI's routes: its pages and files, the browser libraries from node_modules, and the small
JSON API the pages read (the public map as `anon`, aggregate stats, sign-in, a user's own nodes, and
an owner's earnings from web/earnings.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, Field

from neuralgrid.db import queries as q
from neuralgrid.gateway.errors import BadRequest, NotFound, Unauthorized
from neuralgrid.server.deps import ServicesDep, UserDep
from neuralgrid.server.settings import Settings
from neuralgrid.server.stack import api_key, user_token
from neuralgrid.web import earnings
from neuralgrid.web.signin import SESSION_TTL_S, consume_signin_token, signin_user

log = logging.getLogger(__name__)
router = APIRouter(tags=["web"])
router.include_router(earnings.router)

STATIC_DIR = Path(__file__).parent / "static"
REPO_NODE_MODULES = Path(__file__).parents[2] / "node_modules"
# The only files served from node_modules: an allow-list, so no path ever reaches the filesystem.
VENDOR_FILES = {
    "supabase.js": "@supabase/supabase-js/dist/umd/supabase.js",
    "d3-array.min.js": "d3-array/dist/d3-array.min.js",
    "d3-geo.min.js": "d3-geo/dist/d3-geo.min.js",
    "topojson-client.min.js": "topojson-client/dist/topojson-client.min.js",
    "countries-110m.json": "world-atlas/countries-110m.json",
    "swagger-ui-bundle.js": "swagger-ui-dist/swagger-ui-bundle.js",
    "swagger-ui.css": "swagger-ui-dist/swagger-ui.css",
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
}


class SignInRefused(Unauthorized):
    code = "invalid_signin_token"


class SignIn(BaseModel):
    token: str = Field(min_length=1, max_length=200)


# Pages and files -------------------------------------------------------------------------------------


def _send(path: Path, headers: dict[str, str] | None = None) -> FileResponse:
    # no-cache: the browser revalidates (ETag) on every load, so a new version is never stale.
    return FileResponse(
        path,
        media_type=CONTENT_TYPES.get(path.suffix, "application/octet-stream"),
        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff", **(headers or {})},
    )


def _page(request: Request, settings: Settings, name: str) -> FileResponse:
    """An HTML page, with a policy that lets it load nothing but this gateway (and a hosted project)."""
    here = urlsplit(str(request.base_url))
    connect = ["'self'", f"{'wss' if here.scheme == 'https' else 'ws'}://{here.netloc}"]
    if settings.supabase_url:
        project = urlsplit(settings.supabase_url)
        connect += [f"{project.scheme}://{project.netloc}", f"wss://{project.netloc}"]
    policy = (
        "default-src 'self'; img-src 'self' data:; connect-src " + " ".join(connect) + "; "
        "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
    )
    return _send(STATIC_DIR / name, {"content-security-policy": policy, "referrer-policy": "no-referrer"})


@router.get("/", include_in_schema=False)
async def map_page(request: Request, services: ServicesDep) -> FileResponse:
    return _page(request, services.settings, "index.html")


@router.get("/keys", include_in_schema=False)
async def keys_page(request: Request, services: ServicesDep) -> FileResponse:
    return _page(request, services.settings, "keys.html")


@router.get("/operator", include_in_schema=False)
async def operator_page(request: Request, services: ServicesDep) -> FileResponse:
    return _page(request, services.settings, "operator.html")


@router.get("/nodes", include_in_schema=False)
async def owner_page(request: Request, services: ServicesDep) -> FileResponse:
    return _page(request, services.settings, "nodes.html")


@router.get("/signin", include_in_schema=False)
async def signin_page(request: Request, services: ServicesDep) -> FileResponse:
    return _page(request, services.settings, "signin.html")


@router.get("/docs", include_in_schema=False)
async def api_docs() -> HTMLResponse:
    """Swagger UI for the OpenAPI document, its script and styles from this gateway (/vendor), not
    from a CDN as FastAPI's own page has them: it renders offline."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="NeuralGrid API",
        swagger_js_url="/vendor/swagger-ui-bundle.js",
        swagger_css_url="/vendor/swagger-ui.css",
        swagger_favicon_url="/static/favicon.svg",
    )


@router.get("/static/{path:path}", include_in_schema=False)
async def static_file(path: str) -> FileResponse:
    file = (STATIC_DIR / path).resolve()
    if not file.is_relative_to(STATIC_DIR.resolve()) or not file.is_file():
        raise NotFound(f"no such file: /static/{path}", param="path")
    return _send(file)


def vendor_dir() -> Path:
    """node_modules of the checkout, or NEURALGRID_WEB_VENDOR_DIR (an installed package has none)."""
    override = os.environ.get("NEURALGRID_WEB_VENDOR_DIR")
    return Path(override) if override else REPO_NODE_MODULES


@router.get("/vendor/{name}", include_in_schema=False)
async def vendor_file(name: str) -> FileResponse:
    """The browser libraries, from the npm packages that setup installs: no CDN, works offline."""
    if name not in VENDOR_FILES:
        raise NotFound(f"no such file: /vendor/{name}", param="name")
    file = vendor_dir() / VENDOR_FILES[name]
    if not file.is_file():
        log.warning(
            "the web UI needs %s, which is not installed: run `./dev up` (or `npm install` in the"
            " repository), or point NEURALGRID_WEB_VENDOR_DIR at a node_modules folder",
            file,
        )
        raise NotFound(f"/vendor/{name} is not installed on this gateway: run `npm install`", param="name")
    return _send(file)


# The pages' API ---------------------------------------------------------------------------------------


@router.get("/api/config")
async def config(request: Request, services: ServicesDep) -> dict[str, str]:
    """Where the page's supabase-js client connects: a hosted project, or this gateway itself."""
    settings = services.settings
    if settings.supabase_url and settings.supabase_anon_key:
        return {
            "supabase_url": settings.supabase_url,
            "anon_key": settings.supabase_anon_key,
            "mode": "supabase",
        }
    return {
        "supabase_url": str(request.base_url).rstrip("/"),
        "anon_key": api_key(settings.jwt_secret, "anon"),
        "mode": "embedded",
    }


MAX_IDS = 100
SQL_INT_MAX = 2**31 - 1
NodeSort = Literal["status", "name", "gpu", "vram", "tflops", "price", "region", "load", "beat"]


@router.get("/api/nodes")
async def nodes(
    services: ServicesDep,
    search: Annotated[str, Query(alias="q", max_length=200, description="In a name, GPU or region.")] = "",
    sort: NodeSort = "name",
    desc: bool = False,
    offset: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,  # node_list() counts in SQL's integer
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ids: Annotated[str | None, Query(max_length=MAX_IDS * 37, description="Comma-separated node ids")] = None,
) -> dict[str, Any]:
    """The map's table, a page at a time as anyone may see it (node_list(), as anon): searched and
    sorted in the database, never the whole fleet (issue 41); `total` is how many nodes were found.
    With `ids`: those nodes as they are now (the rows a page shows, read again), by name."""
    if ids is not None:
        wanted = _uuids(ids)
        async with services.store.as_role({"role": "anon"}) as store:
            rows = await store.get(q.MAP_NODES_BY_ID, (wanted,))
        return {"object": "list", "data": rows, "total": len(rows)}
    params = {"search": search, "sort": sort, "descending": desc, "offset": offset, "limit": limit}
    async with services.store.as_role({"role": "anon"}) as store:
        page = await store.get(q.NODE_LIST, params)
    return {"object": "list", "data": page["nodes"], "total": page["total"]}


def _uuids(text: str) -> list[uuid.UUID]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if len(parts) > MAX_IDS:
        raise BadRequest(f"at most {MAX_IDS} ids at once", param="ids")
    try:
        return [uuid.UUID(part) for part in parts]
    except ValueError as err:
        raise BadRequest(f"ids: not a node id ({err})", param="ids") from err


@router.get("/api/map/summary")
async def map_summary(services: ServicesDep) -> dict[str, Any]:
    """The fleet by status per map tile, region and GPU model, and its totals: the map's first view,
    the one last broadcast on Realtime's map:summary topic (web/map_feed.py)."""
    return await services.stats.summary(services.store)


@router.get("/api/map/view")
async def map_view(
    services: ServicesDep,
    west: Annotated[float, Query(ge=-180, le=180)],
    south: Annotated[float, Query(ge=-90, le=90)],
    east: Annotated[float, Query(ge=-180, le=180)],
    north: Annotated[float, Query(ge=-90, le=90)],
    cell: Annotated[float, Query(gt=0, le=90, description="Degrees a cluster's cell spans.")] = 1.0,
    max_nodes: Annotated[int, Query(ge=0, le=1000)] = 300,
) -> dict[str, Any]:
    """What a map viewer sees in a box (map_view(), as anon): the nodes in it when they are max_nodes
    or fewer, else clusters of them on a grid of `cell` degrees."""
    box = {"west": west, "south": south, "east": east, "north": north}
    params = {**box, "cell_deg": cell, "max_nodes": max_nodes}
    async with services.store.as_role({"role": "anon"}) as store:
        return dict(await store.get(q.MAP_VIEW, params))


@router.get("/api/stats")
async def stats(services: ServicesDep) -> dict[str, Any]:
    """Fleet totals and job aggregates (jobs are private: read as the gateway, aggregates only)."""
    return await services.stats.get(services.store)


@router.post("/api/auth/signin")
async def signin(body: SignIn, services: ServicesDep) -> dict[str, Any]:
    """Trades a one-time sign-in token (printed by `neuralgrid up`, `signin` or `users add`) for its
    user's session: the local owner's, or the user `users add` made."""
    settings = services.settings
    if settings.supabase_url:
        raise BadRequest("this gateway signs in with Supabase Auth: use the email sign-in on the page")
    email = await asyncio.to_thread(consume_signin_token, settings, body.token)
    user_id = None if email is None else await signin_user(services.store, email)
    if email is None or user_id is None:
        raise SignInRefused(
            "this sign-in link is not valid: it expired (after 10 minutes), was already used or its user"
            " is gone; `neuralgrid signin` (or `neuralgrid users add EMAIL`) prints a new one",
            param="token",
        )
    expires_at = int(time.time()) + SESSION_TTL_S  # taken first, so never later than the token's exp
    token = user_token(settings.jwt_secret, user_id, email, SESSION_TTL_S)
    return {"access_token": token, "expires_at": expires_at, "user": {"id": user_id, "email": email}}


@router.get("/api/my/nodes")
async def my_nodes(services: ServicesDep, claims: UserDep) -> dict[str, Any]:
    """The signed-in user's own nodes, read as that user (RLS and column grants apply)."""
    async with services.store.as_role(claims) as store:
        rows = await store.all(q.MY_NODES)
    return {"object": "list", "data": rows}
