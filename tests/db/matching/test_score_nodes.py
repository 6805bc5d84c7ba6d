"""score_nodes(): hard filters, the seed formula, the balanced policy, explanations."""

from __future__ import annotations

import psycopg
import pytest

from neuralgrid.db.errors import InvalidRequest, NotFound
from neuralgrid.db.matching import MatchRequest, score_nodes
from tests.conftest import LLAMA8, make_node


def ranking(conn: psycopg.Connection, **kw: object) -> list[str]:
    request = MatchRequest(model=kw.pop("model", LLAMA8), **kw)  # type: ignore[arg-type]
    return [r.name for r in score_nodes(conn, request)]


def test_seed_policy_is_the_original_formula(conn: psycopg.Connection) -> None:
    specs = {
        "big-cheap": (80, 312.0, 0.8),
        "small-fast": (24, 165.0, 0.35),
        "free-ish": (24, 71.0, 0.0),
        "exact": (18, 60.0, 0.2),
    }
    for name, (vram, tflops, rate) in specs.items():
        make_node(conn, name, vram_gb=vram, tflops=tflops, hourly_rate=rate)
    rows = score_nodes(conn, MatchRequest(model=LLAMA8, min_vram_gb=18, policy="seed"))

    def original(vram: float, tflops: float, rate: float, min_vram: float = 18) -> float:
        return vram / min_vram * 0.3 + tflops / 100 * 0.5 + 1 / (rate + 0.01) * 0.2

    expected = sorted(specs, key=lambda n: -original(*specs[n]))
    assert [r.name for r in rows] == expected
    for r in rows:
        assert r.score == pytest.approx(original(*specs[r.name]), rel=1e-6)
    # The flaw the design brief names: a near-free node wins on price alone.
    assert rows[0].name == "free-ish"


def test_seed_keeps_only_the_original_filters(conn: psycopg.Connection) -> None:
    make_node(conn, "cold", models={LLAMA8: "available"})
    make_node(conn, "other-model", models={"Qwen/Qwen2.5-0.5B-Instruct": "loaded"})
    make_node(conn, "too-small", vram_gb=16)
    make_node(conn, "offline", status="offline")
    assert sorted(ranking(conn, policy="seed")) == ["cold", "other-model"]


def test_balanced_applies_every_hard_filter_and_explains(conn: psycopg.Connection) -> None:
    make_node(conn, "ok")
    make_node(conn, "offline", status="offline")
    make_node(conn, "draining", status="draining")
    make_node(conn, "small", vram_gb=16)
    make_node(conn, "wrong-model", models={"Qwen/Qwen2.5-0.5B-Instruct": "loaded"})
    make_node(conn, "full", inflight=4, max_concurrency=4)
    make_node(conn, "cooling")
    make_node(conn, "stale")
    make_node(conn, "pricey", hourly_rate=5)
    conn.execute("update nodes set cooldown_until = now() + interval '1 minute' where name = 'cooling'")
    conn.execute("update nodes set last_heartbeat_at = now() - interval '16 seconds' where name = 'stale'")

    rows = score_nodes(conn, MatchRequest(model=LLAMA8, max_hourly_rate=1.0), explain=True)
    reasons = {r.name: r.reject_reason or "" for r in rows}
    assert [r.name for r in rows if r.rank] == ["ok"]
    assert reasons["offline"] == "status is offline"
    assert reasons["draining"] == "status is draining"
    assert reasons["small"] == "16 GB VRAM, needs 18 GB"
    assert reasons["wrong-model"] == f"does not hold {LLAMA8}"
    assert reasons["full"] == "at capacity (4/4)"
    assert reasons["cooling"].startswith("cooling down until")
    assert reasons["stale"].startswith("heartbeat is stale")
    assert reasons["pricey"] == "costs $5.00/h, over the cap of $1.00/h"
    # Without explain only the eligible nodes come back.
    assert ranking(conn, max_hourly_rate=1.0) == ["ok"]


def test_components_are_normalized(conn: psycopg.Connection) -> None:
    make_node(conn, "a", vram_gb=80, tflops=989, hourly_rate=2.5, inflight=3, max_concurrency=4)
    make_node(conn, "b", vram_gb=18, tflops=10, hourly_rate=0, models={LLAMA8: "available"})
    for r in score_nodes(conn, MatchRequest(model=LLAMA8, region="eu-west")):
        for c in (
            r.fit,
            r.compute,
            r.price,
            r.warm,
            r.capacity,
            r.reputation,
            r.proximity,
            r.score,
        ):
            assert c is not None and 0.0 <= c <= 1.0
    by_name = {r.name: r for r in score_nodes(conn, MatchRequest(model=LLAMA8))}
    assert by_name["b"].fit == pytest.approx(1.0)  # just big enough
    assert by_name["a"].fit == pytest.approx(18 / 80)
    assert by_name["a"].capacity == pytest.approx(0.25)
    assert (by_name["a"].warm, by_name["b"].warm) == (1.0, 0.0)


def test_balanced_prefers_right_sized_nodes(conn: psycopg.Connection) -> None:
    # Same compute, price and everything else: only the size differs.
    make_node(conn, "oversized", vram_gb=80)
    make_node(conn, "right-sized", vram_gb=24)
    assert ranking(conn) == ["right-sized", "oversized"]


def test_balanced_prefers_warm_nodes(conn: psycopg.Connection) -> None:
    make_node(conn, "cold-fast", tflops=300, models={LLAMA8: "available"})
    make_node(conn, "warm", models={LLAMA8: "loaded"})
    assert ranking(conn) == ["warm", "cold-fast"]


def test_balanced_prefers_reliable_free_and_close_nodes(conn: psycopg.Connection) -> None:
    make_node(conn, "flaky", successes=1, failures=9)
    make_node(conn, "solid", successes=9, failures=1)
    assert ranking(conn) == ["solid", "flaky"]
    conn.execute("delete from nodes")
    make_node(conn, "loaded", inflight=3)
    make_node(conn, "idle", inflight=0)
    assert ranking(conn) == ["idle", "loaded"]
    conn.execute("delete from nodes")
    conn.execute(
        "update matching_policies set proximity = 0.3 where name = 'balanced'"
    )  # an operator's choice
    make_node(conn, "tokyo", region="ap-northeast", latitude=35.68, longitude=139.69)
    make_node(conn, "frankfurt", region="eu-central", latitude=50.11, longitude=8.68)
    assert ranking(conn, latitude=48.85, longitude=2.35) == ["frankfurt", "tokyo"]  # from Paris
    assert ranking(conn, region="ap-northeast") == ["tokyo", "frankfurt"]


def test_operators_change_weights_without_a_migration(conn: psycopg.Connection) -> None:
    make_node(conn, "cheap", hourly_rate=0.1, tflops=50)
    make_node(conn, "fast", hourly_rate=2.0, tflops=900)
    conn.execute("update matching_policies set price = 1, compute = 0 where name = 'balanced'")
    assert ranking(conn)[0] == "cheap"
    conn.execute("update matching_policies set price = 0, compute = 1 where name = 'balanced'")
    assert ranking(conn)[0] == "fast"
    conn.execute(
        "insert into matching_policies (name, description, compute) values ('speed', 'only speed', 1)"
    )
    assert ranking(conn, policy="speed")[0] == "fast"


def test_limit_and_ties_are_deterministic(conn: psycopg.Connection) -> None:
    ids = sorted(str(make_node(conn)) for _ in range(5))
    rows = score_nodes(conn, MatchRequest(model=LLAMA8), limit=3)
    assert [r.rank for r in rows] == [1, 2, 3]
    assert [str(r.node_id) for r in rows] == ids[:3]  # equal scores: by id


def test_bad_requests_get_clear_errors(conn: psycopg.Connection) -> None:
    with pytest.raises(NotFound, match='unknown model "no/such-model"'):
        score_nodes(conn, MatchRequest(model="no/such-model"))
    with pytest.raises(InvalidRequest, match='unknown matching policy "fancy"'):
        score_nodes(conn, MatchRequest(model=LLAMA8, policy="fancy"))
    with pytest.raises(InvalidRequest, match="min VRAM must be positive"):
        score_nodes(conn, MatchRequest(model=LLAMA8, min_vram_gb=0))
    with pytest.raises(InvalidRequest, match="both latitude and longitude"):
        score_nodes(conn, MatchRequest(model=LLAMA8, latitude=1.0))


def test_uncatalogued_model_is_served_by_nodes_that_hold_it(conn: psycopg.Connection) -> None:
    make_node(conn, "ollama-box", models={"llama3.2:3b": "loaded"})
    assert ranking(conn, model="llama3.2:3b") == ["ollama-box"]
