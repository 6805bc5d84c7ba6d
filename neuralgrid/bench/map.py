"""`neuralgrid bench map`: the fleet map in a real browser at 1,000, 10,000 and 100,000 nodes.

A gateway (`neuralgrid up`, its own process) serves a scratch database. For each fleet size the nodes
are written in bulk in SQL (without their triggers, as a restore writes them: the broadcast of each
insert is not what is measured), spread around the platform's ten regions' cities. Headless Chromium
(Debian's, through Playwright) then opens the map, in a fresh context each round, and reports:

- first paint and first contentful paint (the Paint Timing API: the page's frame, before any data);
- map ready: the page's own `map-ready` mark, when the fleet is first drawn (clusters or markers, the
  stats and the table's first page): the first paint of the map itself;
- the JS heap after a garbage collection, the DOM's elements, and the JSON the page read (bytes).

Then the CPU of Postgres and of the gateway a second with nothing changing, first with no page open
(the gateway's own upkeep, its sweep over the fleet), then with the page open and live (its feed
adds the rest); and with the page live while a writer in its own process changes node statuses at a
fixed rate (each in its own transaction): the page's Realtime messages a second (every frame its
socket receives, and the summaries among them), their bytes and the page's requests.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from neuralgrid.bench import CpuMeter, postmaster_pid, scratch_database, served
from neuralgrid.bench.realtime import write_changes
from neuralgrid.protocol.regions import REGIONS
from neuralgrid.server.serving import free_port

SCRATCH_DB = "neuralgrid_bench_map"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
GPUS = (
    ("NVIDIA GeForce RTX 4090", 24, 165, 0.35),
    ("NVIDIA GeForce RTX 3090", 24, 71, 0.22),
    ("NVIDIA L4", 24, 121, 0.40),
    ("NVIDIA A10", 24, 125, 0.55),
    ("NVIDIA A100 80GB", 80, 312, 1.60),
    ("NVIDIA H100 80GB HBM3", 80, 989, 2.50),
)
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
]
READY_TIMEOUT_S = 120.0
QUIET_S = 5.0  # seconds the fleet is watched (and not) with nothing changing
SETTLE_S = 11.0  # the feed counts the fleet for 10 s after a change
WARM_LOADS = 2  # page loads at each size before those measured (the gateway's plans and caches)


@dataclass(frozen=True)
class Rest:
    """The fleet at rest, watched and not: the base its live figures are measured against."""

    quiet_s: float = QUIET_S
    settle_s: float = SETTLE_S  # less: the quiet figures count the last changes' summaries too


class BenchMapError(RuntimeError):
    """The benchmark cannot run here (no Chromium), or the page did not draw the fleet."""


def chromium() -> str:
    path = shutil.which("chromium") or os.environ.get("NEURALGRID_CHROMIUM")
    if path is None:
        raise BenchMapError(
            "bench map drives Debian's Chromium through Playwright: `apt-get install chromium` (./dev test"
            " installs it), or set NEURALGRID_CHROMIUM to a Chromium binary"
        )
    return path


def write_fleet(db_url: str, nodes: int) -> None:
    """`nodes` nodes in place of the fleet, in bulk: each near one of the regions' cities (a spread of
    some 6 degrees of latitude and 8 of longitude), 80% online, 10% offline, 5% busy, 5% draining, six
    GPU models, one warm model each; then analyzed, as autovacuum would."""
    cities = list(REGIONS.items())
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("update public.platform_settings set heartbeat_interval_s = 86400")  # no sweeps
        conn.execute("truncate public.nodes cascade")
        conn.execute(
            "update public.map_feed set summary = null, seq = 0, checked_at = '-infinity', sent_at = null"
        )
        # No triggers, as a restore writes rows; a role that may not (no superuser) runs them, slower.
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("set session_replication_role = replica")
        conn.execute("select setseed(0.41)")
        conn.execute(
            """
            with c(i, region, lat, lon) as (
              select * from unnest(%s::int[], %s::text[], %s::float8[], %s::float8[])),
            g(i, model, vram, tflops, rate) as (
              select * from unnest(%s::int[], %s::text[], %s::real[], %s::real[], %s::numeric[])),
            s as (select x, random() as a, random() as b, random() as c, random() as d, random() as e
                  from generate_series(1, %s) x)
            insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude,
                                      longitude, endpoint_url, status, last_heartbeat_at)
            select format('map-%%s', lpad(s.x::text, 6, '0')), g.model, g.vram, g.tflops, g.rate, c.region,
                   greatest(-85, least(85, c.lat + (s.a + s.b - 1) * 6)),
                   greatest(-180, least(180, c.lon + (s.c + s.d - 1) * 8)), 'http://127.0.0.1:9/',
                   case when s.e < 0.8 then 'online' when s.e < 0.9 then 'offline'
                        when s.e < 0.95 then 'busy' else 'draining' end, now()
            from s join c on c.i = s.x %% %s join g on g.i = s.x / %s %% %s
            """,
            (
                list(range(len(cities))),
                [name for name, _ in cities],
                [lat for _, (lat, _) in cities],
                [lon for _, (_, lon) in cities],
                list(range(len(GPUS))),
                *([gpu[k] for gpu in GPUS] for k in range(4)),
                nodes,
                len(cities),
                len(cities),
                len(GPUS),
            ),
        )
        conn.execute(
            "insert into public.node_models (node_id, model_id) select id, %s from public.nodes", (MODEL,)
        )
        conn.execute("set session_replication_role = origin")
        conn.execute("analyze public.nodes")
        conn.execute("analyze public.node_models")


@dataclass
class Load:
    """One page load's figures."""

    first_paint_ms: float
    first_contentful_paint_ms: float
    map_ready_ms: float
    js_heap_mb: float
    dom_elements: int
    json_kb: float
    markers: int
    clusters: int
    rows: int


def _ready(page: Any, timeout_s: float) -> None:
    """The page's map-ready mark (polled: the page's policy forbids Playwright's evaluated predicates)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate("performance.getEntriesByName('map-ready').length > 0"):
        if time.monotonic() > deadline:
            raise BenchMapError(f"the map did not draw the fleet within {timeout_s:.0f} s")
        time.sleep(0.05)


def load_page(browser: Any, url: str) -> Load:
    """The map opened in a fresh context (an empty cache): its paints, when it drew the fleet, its heap."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    try:
        page = context.new_page()
        read = [0]

        def answered(response: Any) -> None:
            if "/api/" in response.url or "/rest/v1/" in response.url:
                read[0] += int(response.headers.get("content-length") or len(response.body()))

        page.on("response", answered)
        page.goto(url)
        _ready(page, READY_TIMEOUT_S)
        seen = page.evaluate(
            """() => ({
              paint: Object.fromEntries(
                performance.getEntriesByType('paint').map((e) => [e.name, e.startTime])),
              ready: performance.getEntriesByName('map-ready')[0].startTime,
              dom: document.getElementsByTagName('*').length,
              markers: document.querySelectorAll('#map g.node').length,
              clusters: document.querySelectorAll('#map g.cluster').length,
              rows: document.querySelectorAll('#nodes-body tr').length,
            })"""
        )
        cdp = context.new_cdp_session(page)
        cdp.send("HeapProfiler.collectGarbage")
        cdp.send("Performance.enable")
        metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        return Load(
            first_paint_ms=round(seen["paint"].get("first-paint", 0.0), 1),
            first_contentful_paint_ms=round(seen["paint"].get("first-contentful-paint", 0.0), 1),
            map_ready_ms=round(seen["ready"], 1),
            js_heap_mb=round(metrics["JSHeapUsedSize"] / 2**20, 2),
            dom_elements=int(seen["dom"]),
            json_kb=round(read[0] / 1024, 1),
            markers=int(seen["markers"]),
            clusters=int(seen["clusters"]),
            rows=int(seen["rows"]),
        )
    finally:
        context.close()


@dataclass
class Live:
    frames: list[tuple[float, int, bool]] = field(default_factory=list)  # (when, bytes, a summary)
    requests: list[float] = field(default_factory=list)


def _is_summary(frame: str) -> bool:
    return '"summary"' in frame and "realtime:map:summary" in frame


def watch_live(
    browser: Any, url: str, db_url: str, rate: int, seconds: float, meter: CpuMeter, rest: Rest
) -> dict[str, Any]:
    """The page open and live while `rate` node statuses a second change for `seconds`: what its
    Realtime socket received, what it asked, and the CPU of Postgres and the gateway, a second."""
    # Nothing changing and nobody watching: the gateway's own upkeep (its sweep over the fleet), the base.
    base, base_at = meter.read(), time.monotonic()
    time.sleep(rest.quiet_s)
    base_s = time.monotonic() - base_at
    unwatched = {name: cpu - base[name] for name, cpu in meter.read().items()}
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    live = Live()
    try:
        page = context.new_page()

        def socket(ws: Any) -> None:
            ws.on(
                "framereceived",
                lambda payload: live.frames.append(
                    (
                        time.monotonic(),
                        len(payload),
                        '"summary"' in str(payload) and "map:summary" in str(payload),
                    )
                ),
            )

        page.on("websocket", socket)
        page.on("request", lambda r: live.requests.append(time.monotonic()) if "/api/" in r.url else None)
        page.goto(url)
        _ready(page, READY_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while page.evaluate("document.getElementById('live').dataset.state") != "live":
            if time.monotonic() > deadline:
                raise BenchMapError("the map did not go live within 30 s")
            time.sleep(0.1)
        time.sleep(rest.settle_s)  # the fleet at rest as the feed sees it: no change in the last 10 s
        # Nothing changing, the viewer watching: what its feed costs besides the base.
        quiet, quiet_at = meter.read(), time.monotonic()
        page.wait_for_timeout(rest.quiet_s * 1000)
        quiet_s = time.monotonic() - quiet_at
        idle = {name: cpu - quiet[name] for name, cpu in meter.read().items()}
        spawn = multiprocessing.get_context("spawn")
        results = spawn.Queue()
        writer = spawn.Process(target=write_changes, args=(db_url, rate, seconds, results), daemon=True)
        before, started = meter.read(), time.monotonic()
        writer.start()
        while results.empty():
            if not writer.is_alive() and results.empty():
                raise BenchMapError(f"the writer of changes stopped (exit code {writer.exitcode})")
            page.wait_for_timeout(100)
        _, achieved = results.get()
        writer.join()
        page.wait_for_timeout(1200)  # the last change's summary
        window = time.monotonic() - started
        used = {name: cpu - before[name] for name, cpu in meter.read().items()}
    finally:
        context.close()
    frames = [f for f in live.frames if f[0] >= started]
    summaries = [f for f in frames if f[2]]
    return {
        "changes_per_s": round(achieved, 1),
        "seconds": round(window, 2),
        "messages_per_s": round(len(frames) / window, 2),
        "summaries_per_s": round(len(summaries) / window, 2),
        "bytes_per_s": round(sum(f[1] for f in frames) / window, 1),
        "summary_bytes_max": max((f[1] for f in summaries), default=0),
        "requests_per_s": round(len([r for r in live.requests if r >= started]) / window, 2),
        **{f"{name}_cpu_ms_per_s": round(cpu * 1000 / window, 1) for name, cpu in used.items()},
        **{f"quiet_{name}_cpu_ms_per_s": round(cpu * 1000 / quiet_s, 1) for name, cpu in idle.items()},
        **{f"unwatched_{name}_cpu_ms_per_s": round(c * 1000 / base_s, 1) for name, c in unwatched.items()},
    }


def median_load(loads: list[Load]) -> dict[str, Any]:
    """Each figure's median over the rounds (the counts are the same in every round)."""
    keys = [k for k in Load.__dataclass_fields__ if k not in ("markers", "clusters", "rows", "dom_elements")]
    summary: dict[str, Any] = {k: round(statistics.median(getattr(x, k) for x in loads), 2) for k in keys}
    summary.update(
        {k: getattr(loads[-1], k) for k in ("markers", "clusters", "rows", "dom_elements")},
        rounds=len(loads),
        map_ready_ms_each=[x.map_ready_ms for x in loads],
    )
    return summary


def run(
    admin_url: str,
    sizes: list[int],
    rounds: int,
    rate: int,
    seconds: float,
    progress: Callable[[str], None] = lambda _: None,
    rest: Rest = Rest(),
) -> list[dict[str, Any]]:
    from playwright.sync_api import sync_playwright

    executable = chromium()
    port = free_port()
    results = []
    with (
        scratch_database(admin_url, SCRATCH_DB) as db_url,
        tempfile.TemporaryDirectory(prefix="bench-map-") as home,
    ):
        env = {
            **os.environ,
            "DATABASE_URL": db_url,
            "NEURALGRID_HOME": home,  # not the developer's stack record
            "NEURALGRID_PORT": str(port),
            "NEURALGRID_JWT_SECRET": os.urandom(32).hex(),
        }
        url = f"http://127.0.0.1:{port}/"
        with (
            served([sys.executable, "-m", "neuralgrid.cli", "up"], env, f"{url}readyz") as gateway,
            sync_playwright() as playwright,
        ):
            browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
            meter = CpuMeter({"postgres": [postmaster_pid(db_url)], "gateway": [gateway.pid]})
            try:
                for size in sizes:
                    progress(f"{size:,} nodes: written in bulk")
                    write_fleet(db_url, size)
                    for _ in range(WARM_LOADS):
                        load_page(browser, url)
                    progress(f"{size:,} nodes: {rounds} page loads")
                    loads = [load_page(browser, url) for _ in range(rounds)]
                    progress(f"{size:,} nodes: the page live while {rate} statuses a second change")
                    live = watch_live(browser, url, db_url, rate, seconds, meter, rest)
                    results.append({"nodes": size, **median_load(loads), "live": live})
            finally:
                browser.close()
    if results:
        base = results[0]["map_ready_ms"]
        for r in results:
            r["map_ready_over_smallest"] = round(r["map_ready_ms"] / base, 3) if base else None
    return results
