"""The simulator's numpy twin decides as the SQL does: the same ranking and scores as score_nodes()
(full scan and fast path) on random fleets with measured speeds, cooldowns and outside load, for
every simulated model, under random weights and random VRAM pressure; the same pressure as the
sweeper's refresh_vram_pressure(), requests waiting in the gateways' lines included; and the same
scarcity rule as place() (kept_level(), kept_last())."""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import psycopg
import pytest

from neuralgrid.db import queries as q
from neuralgrid.db.matching import MatchRequest, score_nodes
from neuralgrid.db.store import SyncStore
from neuralgrid.sim.policies import FleetArrays, VramPressure, kept_last, kept_level, score
from neuralgrid.sim.report import load_catalog
from tests.conftest import make_node, running_job

REGIONS = ["us-east", "us-west", "eu-west", "eu-central", "ap-northeast", "sa-east"]
FLEET_COLUMNS = (
    "select n.id, n.vram_gb, n.tflops, n.hourly_rate::float8, n.region, n.inflight, n.max_concurrency,"
    " n.successes, n.failures, n.status = 'online', n.speed_ratio, coalesce(n.cooldown_until > now(), false),"
    " n.outside_load from nodes n order by n.id"
)


def catalog_models(conn: psycopg.Connection) -> dict[str, float]:
    """Every model in the catalog (the simulated ones and the rest) and the VRAM it needs."""
    return {
        r[0]: float(r[1]) for r in conn.execute("select id, min_vram_gb from models order by id").fetchall()
    }


def random_fleet(conn: psycopg.Connection, rng: random.Random, size: int = 30) -> None:
    conn.execute("delete from nodes")
    models = catalog_models(conn)
    for i in range(size):
        conc = rng.choice([1, 4, 8])
        inflight = rng.randint(0, conc)
        make_node(
            conn,
            f"n{i}",
            vram_gb=rng.choice([16, 24, 40, 48, 80]),
            tflops=rng.choice([71, 121, 165, 312, 989]),
            hourly_rate=rng.choice([0.0, 0.2, 0.35, 0.6, 1.1, 2.5]),
            region=rng.choice(REGIONS),
            status=rng.choice(["online"] * 6 + ["offline"]),
            max_concurrency=conc,
            inflight=inflight,
            queue_depth=inflight + rng.choice([0, 0, 1, 3]),  # some load from outside the platform
            successes=rng.randint(0, 30),
            failures=rng.randint(0, 5),
            speed_ratio=rng.choice([None, None, 0.1, 0.3, 0.8, 1.4]),
            cooldown_until=rng.choice([None] * 5 + [datetime.now(UTC) + timedelta(minutes=1)]),
            models={m: rng.choice(["loaded", "available"]) for m in models if rng.random() < 0.7},
        )


def fleet_arrays(conn: psycopg.Connection) -> tuple[list[Any], FleetArrays]:
    rows = conn.execute(FLEET_COLUMNS).fetchall()
    return [r[0] for r in rows], FleetArrays(
        vram_gb=np.array([r[1] for r in rows], dtype=np.float64),
        tflops=np.array([r[2] for r in rows], dtype=np.float64),
        hourly_rate=np.array([r[3] for r in rows]),
        region=np.array([REGIONS.index(r[4]) for r in rows]),
        inflight=np.array([r[5] for r in rows]),
        max_concurrency=np.array([r[6] for r in rows]),
        successes=np.array([r[7] for r in rows], dtype=np.float64),
        failures=np.array([r[8] for r in rows], dtype=np.float64),
        online=np.array([r[9] for r in rows]),
        speed_ratio=np.array([np.nan if r[10] is None else r[10] for r in rows], dtype=np.float64),
        cooling=np.array([r[11] for r in rows]),
        outside_load=np.array([r[12] for r in rows]),
    )


def model_states(conn: psycopg.Connection, ids: list[Any], model: str) -> tuple[np.ndarray, np.ndarray]:
    state: dict[Any, str] = dict(
        conn.execute("select node_id, state from node_models where model_id = %s", (model,)).fetchall()
    )
    holds = np.array([i in state for i in ids])
    return holds, np.array([state.get(i) == "loaded" for i in ids])


def random_weights(conn: psycopg.Connection, rng: random.Random) -> None:
    """Random weights and half-points for `balanced` (the triggers rescore node_scores)."""
    names = ("fit", "compute", "price", "warm", "capacity", "reputation", "proximity", "reserve")
    weights = {n: rng.choice([0.0, 0.02, 0.1, 0.3, 0.7]) for n in names}
    weights["compute"] += 0.01  # at least one positive
    conn.execute(
        "update matching_policies set fit = %(fit)s, compute = %(compute)s, price = %(price)s,"
        " warm = %(warm)s, capacity = %(capacity)s, reputation = %(reputation)s,"
        " proximity = %(proximity)s, reserve = %(reserve)s, compute_half_tflops = %(half)s,"
        " price_half_usd_per_tflop_hour = %(price_half)s where name = 'balanced'",
        {**weights, "half": rng.choice([50, 100, 400]), "price_half": rng.choice([0.001, 0.003, 0.01])},
    )


def random_pressure(conn: psycopg.Connection, rng: random.Random) -> list[tuple[float, float]]:
    conn.execute("delete from private.vram_pressure")
    levels = sorted({float(r[0]) for r in conn.execute("select min_vram_gb from models").fetchall()})
    pairs = [(level, rng.choice([0.0, 0.0, 0.2, 0.5, 0.9, 1.0])) for level in levels]
    for level, p in pairs:
        conn.execute("insert into private.vram_pressure (level_gb, pressure) values (%s, %s)", (level, p))
    return pairs


def test_the_twin_ranks_and_scores_as_score_nodes(conn: psycopg.Connection) -> None:
    rng = random.Random(17)
    cases = 0
    for _fleet in range(6):
        random_fleet(conn, rng)
        random_weights(conn, rng)
        ids, fleet = fleet_arrays(conn)
        _catalog, weights = load_catalog(conn)
        needs = catalog_models(conn)
        for _ in range(12):
            pressure = random_pressure(conn, rng)
            for model, need in needs.items():
                holds, loaded = model_states(conn, ids, model)
                policy = rng.choice(["balanced", "balanced", "balanced", "seed"])
                region = rng.choice([None, *REGIONS])
                cap = rng.choice([None, None, 0.5, 1.5])
                limit = rng.choice([None, 1, 3, 8])
                request = MatchRequest(model=model, policy=policy, region=region, max_hourly_rate=cap)
                # With a limit and no explanation, score_nodes takes the index fast path.
                sql = [r for r in score_nodes(conn, request, explain=limit is None, limit=limit) if r.rank]
                order, scores = score(
                    policy,
                    weights.get("balanced"),
                    fleet,
                    need,
                    holds,
                    loaded,
                    None if region is None else REGIONS.index(region),
                    cap,
                    pressure=pressure,
                )
                if limit is not None:
                    order, scores = order[:limit], scores[:limit]
                context = (model, policy, region, cap, limit, pressure)
                assert [ids[i] for i in order] == [r.node_id for r in sql], context
                assert scores == pytest.approx([r.score for r in sql], rel=1e-5), context  # float4 weights
                cases += 1
    assert cases == 6 * 12 * len(catalog_models(conn))


def test_the_twin_measures_pressure_as_the_sweeper_does(conn: psycopg.Connection) -> None:
    """Running jobs and waiting requests by VRAM need against the slots of online nodes, smoothed
    over time."""
    rng = random.Random(5)
    random_fleet(conn, rng, size=20)
    _ids, fleet = fleet_arrays(conn)
    levels = [float(r[0]) for r in conn.execute("select distinct min_vram_gb from models").fetchall()]
    twin = VramPressure(levels, window_s=30.0)
    conn.execute("delete from private.vram_pressure")
    models = catalog_models(conn)
    clock = 0.0
    for step in range(6):
        conn.execute("delete from jobs")
        conn.execute("delete from private.gateways")
        needs = [
            rng.choice([1.0, 2.0, 16.0, 18.0, 20.0, 32.0, 42.0, 200.0]) for _ in range(rng.randint(0, 25))
        ]
        for need in needs:
            running_job(conn, "x", need)
        waiting: list[float] = []
        for _gateway in range(rng.randint(0, 3)):  # each gateway's line, per model
            line = {m: rng.randint(0, 9) for m in rng.sample(sorted(models), rng.randint(0, 4))}
            SyncStore(conn).get(q.GATEWAY_ALIVE_WAITING, (uuid.uuid4(), None, json.dumps(line)))
            waiting += [models[m] for m, count in line.items() for _ in range(count)]
        elapsed = rng.choice([1.0, 5.0, 20.0])
        clock += elapsed
        with conn.transaction():  # one now() for both statements
            if step:  # as if the last refresh was `elapsed` seconds ago
                conn.execute(
                    "update private.vram_pressure set updated_at = now() - make_interval(secs => %s)",
                    (elapsed,),
                )
            conn.execute("select private.refresh_vram_pressure()")
        twin.refresh(clock, needs, fleet, waiting)
        sql = {
            float(level): (busy, pressure)
            for level, busy, pressure in conn.execute(
                "select level_gb, busy, pressure from private.vram_pressure"
            ).fetchall()
        }
        assert sorted(sql) == twin.levels
        for level in twin.levels:
            assert sql[level] == pytest.approx((twin.busy[level], twin.pressure[level]), rel=1e-9, abs=1e-12)
        rows = conn.execute(
            "select level_gb, pressure, slots from private.vram_pressure order by 1"
        ).fetchall()
        assert [(float(r[0]), r[1], r[2]) for r in rows] == pytest.approx(twin.rows(), rel=1e-9, abs=1e-12)


def test_the_twin_keeps_nodes_as_place_does(conn: psycopg.Connection) -> None:
    """kept_level() for every catalog need under random pressures, slots and thresholds, and
    kept_last() on random rankings, waiting or not, as private.kept_level() and kept_last()."""
    rng = random.Random(43)
    random_fleet(conn, rng)
    ids, fleet = fleet_arrays(conn)
    needs = catalog_models(conn)
    levels = sorted(set(needs.values()))
    cases = 0
    for _ in range(40):
        conn.execute("delete from private.vram_pressure")
        slots = sorted((rng.choice([0, 4, 8, 20, 40]) for _ in levels), reverse=True)  # fewer further up
        rows = [
            (level, rng.choice([0.0, 0.1, 0.2, 0.25, 0.5, 1.0]), n)
            for level, n in zip(levels, slots, strict=True)
        ]
        for level, p, n in rows:
            conn.execute(
                "insert into private.vram_pressure (level_gb, pressure, slots) values (%s, %s, %s)",
                (level, p, n),
            )
        threshold = rng.choice([0.1, 0.2, 0.25, 0.5, 1.5])
        conn.execute("update platform_settings set reserve_threshold = %s", (threshold,))
        for need in [*needs.values(), 0.5, 17.0, 500.0]:
            row = conn.execute("select private.kept_level(%s)", (need,)).fetchone()
            assert row is not None
            kept = kept_level(need, rows, threshold)
            assert (None if row[0] is None else float(row[0])) == kept, (need, rows, threshold)
            order = np.array(rng.sample(range(len(ids)), rng.randint(0, len(ids))), dtype=np.int64)
            wait = rng.random() < 0.5
            if kept is None:
                continue
            sql = conn.execute(
                "select private.kept_last(%s::uuid[], %s::real, %s)", ([ids[i] for i in order], kept, wait)
            ).fetchone()
            assert sql is not None
            assert sql[0] == [ids[i] for i in kept_last(order, fleet.vram_gb, kept, wait)]
            cases += 1
    assert cases > 100
