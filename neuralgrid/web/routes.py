"""The web UI's routes: its pages and files, the browser libraries from node_modules, and the small
JSON API the pages read (the public map as `anon`, aggregate stats, sign-in, a user's own nodes)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from psycopg.rows import dict_row
from pydantic import BaseModel, Field

from neuralgrid.db.roles import act_as
from neuralgrid.gateway.deps import Gateway, GatewayDep, UserDep
from neuralgrid.gateway.errors import BadRequest, GatewayError, Unauthorized
from neuralgrid.gateway.routes_keys import as_user
from neuralgrid.server.settings import Settings
from neuralgrid.server.stack import api_key, user_token
from neuralgrid.web.signin import LOCAL_OWNER_EMAIL, SESSION_TTL_S, consume_signin_token, ensure_local_owner

log = logging.getLogger(__name__)
router = APIRouter(tags=["web"])

STATIC_DIR = Path(__file__).parent / "static"
REPO_NODE_MODULES = Path(__file__).parents[2] / "node_modules"
# The only files served from node_modules: an allow-list, so no path ever reaches the filesystem.
VENDOR_FILES = {
    "supabase.js": "@supabase/supabase-js/dist/umd/supabase.js",
    "d3-array.min.js": "d3-array/dist/d3-array.min.js",
    "d3-geo.min.js": "d3-geo/dist/d3-geo.min.js",
    "topojson-client.min.js": "topojson-client/dist/topojson-client.min.js",
    "countries-110m.json": "world-atlas/countries-110m.json",
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
}
STATS_TTL_S = 2.0  # every open map polls stats; one query per gateway per 2 s serves them all


class FileNotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "not_found"


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
async def map_page(request: Request, gateway: GatewayDep) -> FileResponse:
    return _page(request, gateway.settings, "index.html")


@router.get("/keys", include_in_schema=False)
async def keys_page(request: Request, gateway: GatewayDep) -> FileResponse:
    return _page(request, gateway.settings, "keys.html")


@router.get("/operator", include_in_schema=False)
async def operator_page(request: Request, gateway: GatewayDep) -> FileResponse:
    return _page(request, gateway.settings, "operator.html")


@router.get("/signin", include_in_schema=False)
async def signin_page(request: Request, gateway: GatewayDep) -> FileResponse:
    return _page(request, gateway.settings, "signin.html")


@router.get("/static/{path:path}", include_in_schema=False)
async def static_file(path: str) -> FileResponse:
    file = (STATIC_DIR / path).resolve()
    if not file.is_relative_to(STATIC_DIR.resolve()) or not file.is_file():
        raise FileNotFound(f"no such file: /static/{path}", param="path")
    return _send(file)


def vendor_dir() -> Path:
    """node_modules of the checkout, or NEURALGRID_WEB_VENDOR_DIR (an installed package has none)."""
    override = os.environ.get("NEURALGRID_WEB_VENDOR_DIR")
    return Path(override) if override else REPO_NODE_MODULES


@router.get("/vendor/{name}", include_in_schema=False)
async def vendor_file(name: str) -> FileResponse:
    """The browser libraries, from the npm packages that setup installs: no CDN, works offline."""
    if name not in VENDOR_FILES:
        raise FileNotFound(f"no such file: /vendor/{name}", param="name")
    file = vendor_dir() / VENDOR_FILES[name]
    if not file.is_file():
        log.warning(
            "the web UI needs %s, which is not installed: run `./dev up` (or `npm install` in the"
            " repository), or point NEURALGRID_WEB_VENDOR_DIR at a node_modules folder",
            file,
        )
        raise FileNotFound(
            f"/vendor/{name} is not installed on this gateway: run `npm install`", param="name"
        )
    return _send(file)


# The pages' API ---------------------------------------------------------------------------------------


@router.get("/api/config")
async def config(request: Request, gateway: GatewayDep) -> dict[str, str]:
    """Where the page's supabase-js client connects: a hosted project, or this gateway itself."""
    settings = gateway.settings
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


@asynccontextmanager
async def as_anon(gateway: Gateway) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A transaction acting as an anonymous visitor, so grants and RLS decide what the map shows."""
    async with gateway.pool.connection() as conn, conn.transaction():
        await act_as(conn, {"role": "anon"})
        yield conn


# node_map holds the public columns and the models; the load columns come from nodes (granted to anon).
NODES = """
select m.id, m.name, m.gpu_model, m.gpu_count, m.vram_gb, m.tflops, m.hourly_rate::float8 as hourly_rate,
  m.region, m.latitude, m.longitude, m.status, m.max_concurrency, m.inflight, m.last_heartbeat_at,
  m.successes, m.failures, m.ewma_latency_ms, m.ewma_tokens_per_s, m.cooldown_until, m.warm_models,
  m.available_models, n.missed_heartbeats, n.gpu_utilization, n.free_vram_gb, n.queue_depth
from public.node_map m join public.nodes n on n.id = m.id
order by m.name, m.id
"""


@router.get("/api/nodes")
async def nodes(gateway: GatewayDep) -> dict[str, Any]:
    """Every node as anyone may see it: the map's snapshot (live changes come through Realtime)."""
    async with as_anon(gateway) as conn:
        rows = await (await conn.cursor(row_factory=dict_row).execute(NODES)).fetchall()
    return {"object": "list", "data": rows}


# Online means able to serve: 'busy' nodes are online with every slot taken.
STATS = """
with live as (
  select gpu_model, vram_gb, tflops, hourly_rate from public.nodes where status in ('online', 'busy')
)
select
  (select count(*) from live) as online_nodes,
  (select coalesce(sum(vram_gb), 0)::float8 from live) as online_vram_gb,
  (select coalesce(sum(tflops), 0)::float8 from live) as online_tflops,
  (select count(*) from public.jobs where created_at > now() - interval '1 minute') as jobs_last_minute,
  (select percentile_cont(0.5) within group (order by latency_ms) from public.jobs
    where finished_at > now() - interval '5 minutes' and latency_ms is not null) as p50_latency_ms,
  (select coalesce(jsonb_agg(jsonb_build_object('gpu_model', gpu_model, 'hourly_rate', rate)
                             order by rate, gpu_model), '[]')
     from (select gpu_model, min(hourly_rate)::float8 as rate from live group by gpu_model) c
  ) as cheapest
"""


@dataclass
class StatsCache:
    at: float = 0.0
    value: dict[str, Any] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@router.get("/api/stats")
async def stats(request: Request, gateway: GatewayDep) -> dict[str, Any]:
    """Fleet totals and job aggregates. Jobs are private, so this reads them with the gateway's own
    role and returns aggregates only."""
    cache: StatsCache = getattr(request.app.state, "web_stats", None) or StatsCache()
    request.app.state.web_stats = cache
    async with cache.lock:
        if time.monotonic() - cache.at > STATS_TTL_S:
            async with gateway.pool.connection() as conn:
                row = await (await conn.cursor(row_factory=dict_row).execute(STATS)).fetchone()
            cache.value, cache.at = dict(row or {}), time.monotonic()
        return cache.value


@router.post("/api/auth/signin")
async def signin(body: SignIn, gateway: GatewayDep) -> dict[str, Any]:
    """Trades a one-time sign-in token (printed by `neuralgrid up`) for the local owner's session."""
    settings = gateway.settings
    if settings.supabase_url:
        raise BadRequest("this gateway signs in with Supabase Auth: use the email sign-in on the page")
    if not await asyncio.to_thread(consume_signin_token, settings, body.token):
        raise SignInRefused(
            "this sign-in link is not valid: it expired (after 10 minutes) or was already used;"
            " restart `neuralgrid up` for a new one",
            param="token",
        )
    async with gateway.pool.connection() as conn:
        user_id = await ensure_local_owner(conn)
    expires_at = int(time.time()) + SESSION_TTL_S  # taken first, so never later than the token's exp
    token = user_token(settings.jwt_secret, user_id, LOCAL_OWNER_EMAIL, SESSION_TTL_S)
    return {
        "access_token": token,
        "expires_at": expires_at,
        "user": {"id": user_id, "email": LOCAL_OWNER_EMAIL},
    }


MY_NODES = """
select id, name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate::float8 as hourly_rate, region, status,
  max_concurrency, inflight, queue_depth, gpu_utilization, last_heartbeat_at, successes, failures,
  agent_version, created_at
from public.nodes where owner_id = auth.uid()
order by name, id
"""


@router.get("/api/my/nodes")
async def my_nodes(gateway: GatewayDep, claims: UserDep) -> dict[str, Any]:
    """The signed-in user's own nodes, read as that user (RLS and column grants apply)."""
    async with as_user(gateway, claims) as conn:
        rows = await (await conn.cursor(row_factory=dict_row).execute(MY_NODES)).fetchall()
    return {"object": "list", "data": rows}
