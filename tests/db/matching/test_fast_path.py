"""The indexed fast path of score_nodes() ranks exactly as the full scan, and node_scores stays true."""

from __future__ import annotations

import random

import psycopg
import pytest

from neuralgrid.bench.matching import FILL_FLEET
from neuralgrid.db.matching import (
    MatchRequest,
    RankedNode,
    complete_job,
    failover_job,
    match_job,
    score_nodes,
)
from tests.conftest import make_node
from tests.db.plans import logged_plans

MODELS = [
    "meta-llama/Llama-3.1-8B-Instruct",
    "BAAI/bge-large-en-v1.5",
    "meta-llama/Llama-3.3-70B-Instruct-AWQ",
    "custom:uncatalogued",
]
REGIONS = ["us-east", "eu-west", "ap-northeast", "sa-east"]


def random_fleet(conn: psycopg.Connection, rng: random.Random, n: int) -> None:
    for i in range(n):
        held = rng.sample(MODELS, rng.randint(1, len(MODELS)))
        max_conc = rng.choice([1, 2, 4, 8])
        make_node(
            conn,
            f"n{i}",
            models={m: rng.choice(["loaded", "available"]) for m in held},
            vram_gb=rng.choice([8, 16, 24, 40, 48, 80, 160]),
            tflops=rng.choice([30, 71, 121, 165, 312, 989]),
            hourly_rate=round(rng.uniform(0, 3), 2),
            region=rng.choice(REGIONS),
            latitude=rng.uniform(-60, 60),
            longitude=rng.uniform(-180, 180),
            status=rng.choices(["online", "offline", "busy", "draining"], [85, 5, 5, 5])[0],
            max_concurrency=max_conc,
            inflight=rng.randint(0, max_conc),
            queue_depth=rng.choice([0, 0, rng.randint(0, max_conc + 3)]),  # outside load, some over the slots
            successes=rng.randint(0, 50),
            failures=rng.randint(0, 10),
            speed_ratio=rng.choice([None, None, 0.02, 0.3, 1.5]),
        )
    conn.execute("update nodes set last_heartbeat_at = now() - interval '1 minute' where random() < 0.05")
    conn.execute("update nodes set cooldown_until = now() + interval '1 minute' where random() < 0.05")


def random_request(rng: random.Random) -> MatchRequest:
    located = rng.random() < 0.3
    return MatchRequest(
        model=rng.choice(MODELS),
        region=rng.choice([None, *REGIONS]) if not located else None,
        latitude=rng.uniform(-60, 60) if located else None,
        longitude=rng.uniform(-180, 180) if located else None,
        max_hourly_rate=rng.choice([None, None, 0.5, 1.5]),
    )


def full_scan(conn: psycopg.Connection, request: MatchRequest, k: int) -> list[RankedNode]:
    """The reference: explain forces the full scan; keep the ranked rows."""
    return [r for r in score_nodes(conn, request, explain=True) if r.rank is not None][:k]


def assert_same_ranking(conn: psycopg.Connection, rng: random.Random, cases: int) -> None:
    for _ in range(cases):
        request, k = random_request(rng), rng.randint(1, 40)
        fast = score_nodes(conn, request, limit=k)
        slow = full_scan(conn, request, k)
        assert [r.node_id for r in fast] == [r.node_id for r in slow], request
        for a, b in zip(fast, slow, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-12)
            assert (a.fit, a.warm, a.capacity, a.proximity) == pytest.approx(
                (b.fit, b.warm, b.capacity, b.proximity), abs=1e-12
            )


def assert_scores_fresh(conn: psycopg.Connection) -> None:
    """node_scores holds exactly what node_base_scores computes from the current rows."""
    differences = conn.execute(
        """
        select count(*) from node_scores s
        full join node_base_scores v using (policy, model_id, node_id)
        where (s.base_score, s.tier_gb, s.fixed_base, s.capacity_share)
              is distinct from (v.base_score, v.tier_gb, v.fixed_base, v.capacity_share)
        """
    ).fetchone()
    assert differences == (0,)
    assert conn.execute("select count(*) from node_scores").fetchone() != (0,)


def test_fast_path_equals_full_scan_on_random_fleets(conn: psycopg.Connection) -> None:
    rng = random.Random(7)
    random_fleet(conn, rng, 150)
    assert_scores_fresh(conn)
    assert_same_ranking(conn, rng, 150)


def test_node_scores_follow_claims_failures_and_operator_changes(conn: psycopg.Connection) -> None:
    rng = random.Random(11)
    random_fleet(conn, rng, 60)
    for _ in range(30):
        match = match_job(conn, random_request(rng))
        if match.node_id is None:
            continue
        if rng.random() < 0.3:
            failover_job(conn, match.job_id, "boom", candidates=match.fallback_ids)
        elif rng.random() < 0.7:
            complete_job(conn, match.job_id, completion_tokens=rng.randint(1, 100))
    assert_scores_fresh(conn)
    conn.execute("update matching_policies set warm = 0.6, proximity = 0.3 where name = 'balanced'")
    conn.execute("update models set min_vram_gb = 30 where id = %s", (MODELS[0],))
    conn.execute("update node_models set state = 'loaded' where random() < 0.3")
    conn.execute(
        "update nodes set hourly_rate = hourly_rate * 2, successes = successes + 1 where random() < 0.3"
    )
    conn.execute("delete from node_models where random() < 0.1")
    conn.execute(
        "insert into matching_policies (name, description, price, proximity) values ('cheap', 'price', 1, 0.5)"
    )
    conn.execute("delete from models where id = %s", (MODELS[2],))  # now matched as uncatalogued
    assert_scores_fresh(conn)
    assert_same_ranking(conn, rng, 80)
    rows = score_nodes(conn, MatchRequest(model=MODELS[0], policy="cheap", region="eu-west"), limit=5)
    assert [r.node_id for r in rows] == [
        r.node_id for r in full_scan(conn, MatchRequest(model=MODELS[0], policy="cheap", region="eu-west"), 5)
    ]


def test_heartbeats_do_not_rewrite_scores(conn: psycopg.Connection) -> None:
    node = make_node(conn)
    before = conn.execute("select xmin::text from node_scores where node_id = %s", (node,)).fetchone()
    conn.execute("select node_heartbeat(%s)", (node,))
    after = conn.execute("select xmin::text from node_scores where node_id = %s", (node,)).fetchone()
    assert before == after


@pytest.mark.parametrize(
    ("speed", "change"),
    [
        (0.6, "inflight = inflight + 1"),  # a claim
        (0.6, "inflight = inflight - 1, successes = successes + 1"),  # a whole answer's release
        (0.6, "inflight = inflight - 1, failures = failures + 2"),  # a batch of two failures
        (0.6, "queue_depth = 4"),  # outside load
        # A stream's release on a node that keeps up with its claim: compute and price take the
        # speed only up to the claim (least(1, speed_ratio)), so a new measure above it moves neither.
        (1.3, "inflight = inflight - 1, successes = successes + 1, speed_ratio = 1.7"),
        (None, "inflight = inflight - 1, successes = successes + 1, speed_ratio = 1.0"),
    ],
)
def test_a_change_of_load_or_counts_rescores_by_arithmetic(
    conn: psycopg.Connection, speed: float | None, change: str
) -> None:
    """A claim, a release that measured no speed (or none below the node's claim), or outside load
    moves only the capacity and reputation terms: the node's rows become their other part plus those
    terms' shares (a lookup by key), not the components computed again (a join of the node, its
    models, the catalog and the policies). The result is the view's to the last bit."""
    node = make_node(conn, models={m: "loaded" for m in MODELS[:3]}, max_concurrency=4, queue_depth=1)
    conn.execute(
        "update nodes set inflight = 2, successes = 7, failures = 1, speed_ratio = %s where id = %s",
        (speed, node),
    )
    with logged_plans(conn) as plans:
        conn.execute(f"update nodes set {change} where id = %s", (node,))
    (rescoring,) = [plan for plan in plans if "update public.node_scores" in plan]
    assert "Join" not in rescoring and "Nested Loop" not in rescoring, rescoring
    assert_scores_fresh(conn)


def test_anything_else_scored_goes_the_long_way_and_stays_exact(conn: psycopg.Connection) -> None:
    """A stream's release measures a speed (compute, price and reputation move), and a heartbeat's new
    VRAM size moves the node's tier as well."""
    node = make_node(conn, models={m: "loaded" for m in MODELS[:3]}, max_concurrency=4)
    for change in (
        "inflight = 2, successes = successes + 1, speed_ratio = 0.4",
        "inflight = 1, successes = successes + 1, speed_ratio = 1.2",  # back up to its claim
        "inflight = 2, successes = successes + 1, speed_ratio = 0.99",
        "vram_gb = 80",
        "tflops = 90",
    ):
        conn.execute(f"update nodes set {change} where id = %s", (node,))
        assert_scores_fresh(conn)


@pytest.mark.parametrize(
    ("region", "per_candidate"),
    [
        # An unknown caller is 0.5 from every node, and no level is under pressure: both request
        # terms are known without the node, so no function runs for them.
        (None, {"node_is_eligible"}),
        ("eu-west", {"node_is_eligible", "proximity_component"}),
    ],
)
def test_a_placement_runs_no_sql_function_per_candidate_but_the_request_terms_that_vary(
    conn: psycopg.Connection, region: str | None, per_candidate: set[str]
) -> None:
    """A SQL function the planner cannot inline (each pins its search_path, lint 0011) is a separate
    execution per row. The components come from a view instead; per candidate, placing a request
    runs only the walk's eligibility check and those of the request's own terms (proximity,
    reserve) that differ between nodes, once each: the rescoring once evaluated both twice, and the
    components once more."""
    for i in range(16):
        make_node(conn, f"n{i}", hourly_rate=0.2 + i / 100)
    with conn.transaction():
        conn.execute("set local track_functions = 'all'")
        match = match_job(conn, MatchRequest(model=MODELS[0], region=region))
        rows = conn.execute("select funcname::text, calls from pg_stat_xact_user_functions").fetchall()
        calls: dict[str, int] = dict(rows)
    assert match.node_id is not None
    terms = {"node_is_eligible", "proximity_component", "reserve_component"}
    assert {name: calls.get(name) for name in terms} == {
        name: 16 if name in per_candidate else None for name in terms
    }
    assert {name: n for name, n in calls.items() if name not in terms and n > 3} == {}


def test_a_ranking_under_vram_pressure_walks_only_the_tiers_that_hold_nodes(conn: psycopg.Connection) -> None:
    """With bigger VRAM levels under pressure the reserve differs between tiers, so each tier that
    can hold the request is walked on its own (top_by_total, a cursor each). The catalog's tiers
    above a small model's are many; a fleet of one GPU size fills one of them, and the others have
    nothing to walk."""
    small = "BAAI/bge-large-en-v1.5"  # 2 GB: every catalog tier from 2 GB up could hold it
    for i in range(8):
        make_node(conn, f"n{i}", vram_gb=24, models={small: "loaded"})
    conn.execute("insert into private.vram_pressure (level_gb, busy, slots, pressure) values (18, 1, 2, 0.5)")
    request = MatchRequest(model=small)
    with conn.transaction():
        conn.execute("set local track_functions = 'all'")
        ranked = score_nodes(conn, request, limit=3)
        rows = conn.execute("select funcname::text, calls from pg_stat_xact_user_functions").fetchall()
        calls: dict[str, int] = dict(rows)
    assert [r.node_id for r in ranked] == [r.node_id for r in full_scan(conn, request, 3)]
    assert calls.get("top_by_total") == 1

    # Whether a tier has a node is one probe of the tier's index, not a join with every row the
    # model has (at 100,000 nodes that took 22.6 ms a ranking, against 3.4 ms walking every tier).
    with logged_plans(conn) as plans:
        score_nodes(conn, request, limit=3)
    (tiers,) = [plan for plan in plans if "private.top_by_total(" in plan]
    assert "node_scores_tier_rank_idx" in tiers and "Limit" in tiers and "Join" not in tiers


def test_the_tier_probe_reads_the_index_on_an_analyzed_fleet(conn: psycopg.Connection) -> None:
    """Once node_scores is analyzed, the planner knows a tier holds thousands of rows and would read
    the table in order until the first match (a Limit over a Seq Scan), which for a tier that holds
    none is the whole table: 20.9 ms a ranking at 100,000 nodes against 3.7 ms before the analyze.
    The probe asks for the index's own order, which only the index gives cheaply."""
    conn.execute(FILL_FLEET.replace("i %% 7", "1"), {"first": 1, "last": 3000, "model": MODELS[0]})
    conn.execute("analyze public.nodes, public.node_models, public.node_scores")
    conn.execute("insert into private.vram_pressure (level_gb, busy, slots, pressure) values (42, 1, 2, 0.5)")
    request = MatchRequest(model=MODELS[0])
    with logged_plans(conn) as plans:
        ranked = score_nodes(conn, request, limit=3)
    assert [r.node_id for r in ranked] == [r.node_id for r in full_scan(conn, request, 3)]
    (tiers,) = [plan for plan in plans if "private.top_by_total(" in plan]
    assert "Seq Scan on node_scores" not in tiers, tiers
