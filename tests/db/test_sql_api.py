"""The SQL API surface: only the API in `public`, helpers in `private`, each rule written once.

Everything here is SQL as the gateway and pg_cron send it (no Python bindings), so it pins the
database's contract: which functions API roles can reach, that the one-off and batch endings agree,
that a handoff needs no undo, that the budget hold is priced in SQL, and that one call sweeps."""

from __future__ import annotations

import json
import re
import uuid
from decimal import Decimal
from typing import Any, get_args

import psycopg
import pytest

from neuralgrid.db.queries import JobOutcome, JobStatus, NodeStatus
from tests.conftest import LLAMA8, make_key, make_node, past_the_restart

# What Python, the web page, the Edge Functions and the node agents call, overloads counted.
PUBLIC_API = sorted(
    [
        "agent_heartbeat",  # the agent's current heartbeat
        "agent_heartbeat",  # agents of the earlier version
        "agent_heartbeat",  # with pre-warm: the models a server can load, the answers, the load asked
        "agent_heartbeat_with_secret",  # the Edge Function heartbeat's, as neuralgrid_node: checks the secret
        "attach_tunnel",
        "complete_job",
        "complete_jobs",
        "continuing_nodes",
        "create_api_key",
        "detach_tunnel",
        "due_challenges",  # the (node, model)s a gateway's referee can challenge now (issue 39)
        "due_cross_checks",  # where no referee can score: the (node, model)s due, with their peers
        "due_gpu_probes",  # the nodes due a GPU probe (issue 39)
        "failover_job",
        "fleet_stats",  # the map's totals through the Data API (issue 18)
        "gateway_alive",
        "gateway_alive",  # with the address other gateways reach it at
        "gateway_alive",  # with the requests waiting in its lines (issue 43)
        "handoff_job",
        "handoff_job",  # saying whose failure it was (421: the gateway holding the tunnel broke off)
        "map_summary",  # the map's summary of the fleet (issue 41)
        "map_view",  # what a map viewer sees in a box: its nodes, or their clusters
        "match_job",  # the hold given in USD
        "match_job",  # the hold priced in SQL from the request's size
        "my_earnings",  # an owner's earnings (issue 19)
        "my_earnings_totals",
        "my_node_stats",
        "my_model_checks",  # an owner's models under verification, held and forfeited earnings
        "my_nodes",  # an owner's nodes with their endpoints, through the Data API (issue 18)
        "node_heartbeat",
        "node_heartbeats",  # a gateway's beats of the last second in one call (issue 41)
        "node_list",  # the map's table, a page at a time
        "move_to_lease",  # a leased job whose node failed, moved to another leased slot (issue 42)
        "place_job",  # the gateway's: match_job() that may wait for a slot
        "place_job",  # with the request's route: only nodes serving it
        "place_challenge",  # a challenge's job, on exactly its node (issue 39)
        "place_jobs",  # the gateway's placements grouped (issue 16)
        "record_challenges",  # verdicts: the sequential test, its states and consequences
        "record_gpu_probe",  # a GPU probe's outcome: the proof's state, the matcher's hard filter
        "record_jobs",  # leased jobs written behind (issue 42)
        "register_node",
        "register_node",
        "reject_job",
        "request_verification",  # an owner starts a failed model over
        "renew_escrows",  # the money a gateway holds for keys with a budget (issue 42)
        "renew_leases",  # a gateway's slot leases, renewed once a second (issue 42)
        "revoke_api_key",  # a user revokes their own key through the Data API (issue 18)
        "restore_tunnels",  # a gateway that checked in late: the tunnels it holds, recorded again
        "schedule_sweep",  # pg_cron's schedule of sweep(), as its version allows
        "score_nodes",
        "set_tunnel",
        "sweep",
        "sweep_stale_jobs",
        "sweep_stale_nodes",
        "tunnel_route",
    ]
)

PRIVATE_HELPERS = sorted(
    [
        "abandon_job",
        "address_is_public",
        "announce_free_slot",
        "answer_cap",  # the cap on an answer a key's budget pays for (place_job(), place_jobs())
        "api_keys_check_description",  # the rules on what a key is, when written (not claims)
        "api_keys_issued_only",
        "api_keys_revocation_is_final",  # a revoked key's revoked_at never changes again
        "broadcast_job_change",
        "broadcast_node_change",
        "budget_hold",
        "capacity_state",
        "challenge_bounds",  # the sequential test's bounds (issue 39)
        "challenge_key_id",  # the platform's key that pays for challenges
        "challenge_step",  # what one verdict adds to the evidence
        "check_new_node_model",  # a node listing a pinned model is under verification
        "check_owner_endpoint",
        "check_pinned_model",  # a model pinned: its nodes are under verification
        "check_repinned_model",  # pinned to another file: its nodes start over
        "checks_back_in_the_matcher",  # a failed model started over is scored again
        "forfeit_unverified_on_delete",  # a node deleted unverified keeps nothing held
        "claim_node",
        "copy_node_endpoint",
        "cooldown_until",
        "end_attempt",
        "end_jobs",  # complete_jobs()'s one statement; record_jobs() writes jobs ended at once with it
        "endpoint_is_private",
        "gateway_is_live",
        "json_changes",  # what changed between two summaries of the map
        "schedule_sweep_with_pg_cron",
        "take_due_checks",  # the (node, model)s due a challenge, against the referee or peers
        "start_gpu_proof",  # a node with an agent, or new GPU claims: a proof due at once
        "sync_warm_models",  # a heartbeat's warm models (node_heartbeat(), agent_heartbeat())
        "ewma_fold",
        "great_circle_km",
        "moved_into_lease",
        "mark_cold_start",
        "nodes_keep_price_floor",  # a node's lowest recent price per slot (a rise applies later)
        "move_job",
        "node_is_eligible",
        "node_map_payload",
        "node_verification",  # the worst state of a node's models under verification (issue 39)
        "note_node_verification",  # keeps nodes.verification, which the map reads
        "node_scores_after_catalog_change",
        "node_scores_after_node_models_change",
        "node_scores_after_node_update",
        "node_scores_after_nodes_insert",
        "nodes_derive_outside_load",
        "nodes_check_description",  # the rules on what a node is, when written (not claims)
        "nodes_derive_routes",
        "note_map_change",  # a statement changed what the map's summary counts (issue 41)
        "notify_api_key_change",
        "notify_node_secret_change",  # a node's secret changed or the node is gone: gateways forget it
        "parse_ipv4",
        "place",
        "prewarm_for",
        "record_earning",
        "write_earnings",  # the earnings rule (the trigger on jobs' updates, end_jobs())
        "record_node_status",
        "proximity_component",
        "ranking_limit",  # how many nodes a placement ranks (place(), place_jobs())
        "refresh_node_scores",
        "refresh_prewarm_demand",
        "refresh_vram_pressure",
        "reject_reason",
        "release_node",
        "refresh_fleet_activity",
        "release_reservation",
        "kept_last",  # the scarcity rule (issue 43)
        "lane_can_rank",  # whether score_nodes() can rank a lane: its model and policy exist
        "lane_target",  # a gateway's fair share of a lane's slots (renew_leases(), issue 42)
        "lane_turn",  # where the rotation of a scarce lane's left-over slots stands (lane_target())
        "lease_usable_nodes",
        "leased_slots",
        "move_lease_slots",
        "return_lent_slot",  # an idle leased slot a gateway lends a placement (place_jobs())
        "renew_lane",
        "kept_level",
        "required_vram_gb",
        "reserve_component",
        "send_map_summary",  # the map's summary on map:summary, at most once a second
        "set_updated_at",
        "stamp_job_gateway",
        "sweep_dead_tunnels",
        "sweep_leases",  # what leases and escrows hold once nobody renews them (issue 42)
        "sweepable_jobs",  # the jobs a sweep may end now: their nodes and key locked, none waited for
        "sweep_orphaned_jobs",
        "top_by_base",
        "top_by_total",
        "vram_tier",
    ]
)

OURS = "p.pronamespace in ('public'::regnamespace, 'private'::regnamespace)"


def functions_in(conn: psycopg.Connection, schema: str) -> list[str]:
    rows = conn.execute(
        "select p.proname from pg_proc p join pg_namespace n on n.oid = p.pronamespace where n.nspname = %s",
        (schema,),
    ).fetchall()
    return sorted(name for (name,) in rows)


def bodies(conn: psycopg.Connection) -> dict[str, str]:
    """Each of our functions' source, by its signature."""
    rows = conn.execute(
        "select p.oid::regprocedure::text, p.prosrc from pg_proc p join pg_namespace n on n.oid = p.pronamespace"
        " where n.nspname in ('public', 'private')"
    ).fetchall()
    return {str(signature): str(source) for signature, source in rows}


def match(
    conn: psycopg.Connection, key: uuid.UUID | None = None, model: str = LLAMA8, stream: bool = False
) -> uuid.UUID:
    row = conn.execute(
        "select job_id, node_id from match_job(%s, %s, p_stream => %s)", (model, key, stream)
    ).fetchone()
    assert row is not None and row[1] is not None, "no node took the job"
    return uuid.UUID(str(row[0]))


# Which functions are the API -------------------------------------------------------------------


def test_public_holds_the_api_and_private_the_helpers(conn: psycopg.Connection) -> None:
    assert functions_in(conn, "public") == PUBLIC_API
    assert functions_in(conn, "private") == PRIVATE_HELPERS


def test_api_roles_can_reach_no_private_function(conn: psycopg.Connection) -> None:
    for role in ("anon", "authenticated"):
        assert conn.execute("select has_schema_privilege(%s, 'private', 'usage')", (role,)).fetchone() == (
            False,
        )
        reachable = conn.execute(
            "select p.oid::regprocedure::text from pg_proc p"
            " where p.pronamespace = 'private'::regnamespace and has_function_privilege(%s, p.oid, 'execute')",
            (role,),
        ).fetchall()
        assert reachable == [], role
    # As PostgREST would call it: refused outright, whatever the role's JWT says.
    with conn.transaction(force_rollback=True):
        conn.execute(
            "select set_config('request.jwt.claims', %s, true)", (json.dumps({"role": "authenticated"}),)
        )
        conn.execute("set local role authenticated")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("select private.great_circle_km(0, 0, 1, 1)")
    # The helpers are documented, and every security definer function pins its search_path.
    assert (
        conn.execute(
            "select p.oid::regprocedure::text from pg_proc p"
            " where p.pronamespace = 'private'::regnamespace and obj_description(p.oid, 'pg_proc') is null"
        ).fetchall()
        == []
    )
    assert (
        conn.execute(
            f"select p.oid::regprocedure::text from pg_proc p where {OURS} and p.prosecdef"
            " and not coalesce(p.proconfig, '{{}}') @> array['search_path=\"\"']"
        ).fetchall()
        == []
    )


def test_no_body_names_a_helper_where_it_no_longer_is(conn: psycopg.Connection) -> None:
    assert functions_in(conn, "private") == PRIVATE_HELPERS
    stale = re.compile(r"public\.(" + "|".join(PRIVATE_HELPERS) + r")\b")
    assert {sig: stale.findall(src) for sig, src in bodies(conn).items() if stale.search(src)} == {}


# complete_job() is complete_jobs() with a batch of one -------------------------------------------


NODE_AFTER = (
    "select ewma_latency_ms, ewma_tokens_per_s, speed_ratio, successes, failures, consecutive_failures,"
    " round(extract(epoch from cooldown_until - now())) from nodes where id = %s"
)
ONE = "select cost_usd from complete_job(%s, %s, 1000, 90, 100, 1000, %s)"
BATCH = "select cost_usd from complete_jobs(array[%s]::uuid[], array[%s], '{1000}', '{90}', '{100}', '{1000}', array[%s])"


def node_after(conn: psycopg.Connection, node: uuid.UUID) -> tuple[Any, ...]:
    row = conn.execute(NODE_AFTER, (node,)).fetchone()
    assert row is not None
    return tuple(row)


def spent(conn: psycopg.Connection, key: uuid.UUID) -> Decimal:
    row = conn.execute("select spent_usd from api_keys where id = %s", (key,)).fetchone()
    assert row is not None
    return Decimal(row[0])


def assert_each_ending_rule_is_written_once(conn: psycopg.Connection) -> None:
    """The cooldown, the moving average and the price each live in one function's body (the
    price in end_jobs(), which complete_jobs() and record_jobs() call), and complete_job() is
    complete_jobs() with a batch of one."""
    src = bodies(conn)

    def holders(pattern: str) -> list[str]:
        return sorted(sig.split("(")[0] for sig, body in src.items() if re.search(pattern, body))

    assert holders(r"power\(2") == ["private.cooldown_until"]
    assert holders(r"0\.8 \*") == ["private.ewma_fold"]
    assert holders(r"tokens_per_s_per_tflop") == ["private.end_jobs"]
    assert holders(r"private\.end_jobs\(") == ["complete_jobs", "record_jobs"]
    assert holders(r"public\.complete_jobs\(") == ["complete_job"]


@pytest.mark.parametrize(("status", "error"), [("succeeded", None), ("failed", "the node broke")])
def test_complete_job_and_complete_jobs_end_a_job_alike(
    conn: psycopg.Connection, status: str, error: str | None
) -> None:
    assert_each_ending_rule_is_written_once(conn)
    one, batch, other = make_node(conn, "one"), make_node(conn, "batch"), make_node(conn, "other")
    key = make_key(conn)
    conn.execute("update nodes set ewma_latency_ms = 800, speed_ratio = 0.5 where true")
    results: dict[uuid.UUID, tuple[Any, ...]] = {}
    for node, query in ((one, ONE), (batch, BATCH)):
        conn.execute("update nodes set status = case when id = %s then 'online' else 'offline' end", (node,))
        job = match(conn, key, stream=True)  # a stream: its ending measures the node's speed
        before = spent(conn, key)
        row = conn.execute(query, (job, status, error)).fetchone()
        assert row is not None
        results[node] = (row[0], spent(conn, key) - before, *node_after(conn, node))
    assert results[one] == results[batch]
    cost, charged, latency, tps, _, successes, failures, streak, cooldown = results[one]
    assert cost == charged == Decimal("0.00005900")  # 1000 x $0.05 + 90 x $0.10 per million
    if status == "succeeded":
        assert (latency, tps, successes, cooldown) == (pytest.approx(840), pytest.approx(100), 1, None)
    else:
        assert (latency, failures, streak, cooldown) == (800, 1, 1, 5)
        # A failover cools its node down exactly as a failed ending does.
        conn.execute("update nodes set status = case when id = %s then 'online' else 'offline' end", (other,))
        conn.execute("select failover_job(%s, 'boom')", (match(conn),))
        assert node_after(conn, other)[4:] == (failures, streak, cooldown)


# handoff_job(): moves a job as failover_job() does, or changes nothing -----------------------------


def test_handoff_needs_no_undo(conn: psycopg.Connection) -> None:
    src = bodies(conn)
    for signature in ("handoff_job(uuid,text,uuid[])", "failover_job(uuid,text,integer,uuid[])"):
        assert "exception" not in src[signature].lower(), signature
    assert [sig for sig, body in src.items() if "NG404" in body] == []

    first, second = make_node(conn, "first", vram_gb=24), make_node(conn, "second", vram_gb=48)
    job = match(conn)
    counts = (
        "select j.attempts, j.node_id, j.status, n.failures, n.consecutive_failures, n.inflight,"
        " (select array_agg(a.status order by a.attempt) from job_attempts a where a.job_id = j.id)"
        " from jobs j join nodes n on n.id = j.node_id where j.id = %s"
    )
    before = conn.execute(counts, (job,)).fetchone()
    assert before == (1, first, "running", 0, 0, 1, ["running"])
    # Nowhere to go: nothing changes, not even the running node's failure count.
    assert conn.execute("select * from handoff_job(%s, 'dropped', '{}')", (job,)).fetchall() == []
    assert conn.execute(counts, (job,)).fetchone() == before
    # Somewhere to go: the job moves, and the node it left counts a failure.
    moved = conn.execute(
        "select node_id, attempt from handoff_job(%s, 'dropped', %s)", (job, [second])
    ).fetchall()
    assert moved == [(second, 2)]
    assert conn.execute(counts, (job,)).fetchone() == (2, second, "running", 0, 0, 1, ["failed", "running"])
    assert conn.execute(
        "select failures, consecutive_failures, inflight from nodes where id = %s", (first,)
    ).fetchone() == (1, 1, 0)
    # No running attempt: refused, as failover_job() refuses it.
    conn.execute("select complete_job(%s)", (job,))
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="has no running attempt"):
        conn.execute("select * from handoff_job(%s, 'dropped', %s)", (job, [first]))


# match_job() prices the budget hold itself --------------------------------------------------------


PRICED_MATCH = (
    "select job_id, node_id, error from match_job(%s, %s, 'balanced', null, null, null, null, null, false, 3,"
    " %s, %s)"
)


def held(conn: psycopg.Connection, key: uuid.UUID) -> Decimal:
    row = conn.execute("select reserved_usd from api_keys where id = %s", (key,)).fetchone()
    assert row is not None
    return Decimal(row[0])


def test_match_job_holds_the_price_of_the_request_size(conn: psycopg.Connection) -> None:
    make_node(conn, models={LLAMA8: "loaded", "acme/uncatalogued-7b": "loaded"}, max_concurrency=8)
    key = make_key(conn, budget_usd=1.0)
    prices = conn.execute(
        "select input_usd_per_mtok, output_usd_per_mtok from models where id = %s", (LLAMA8,)
    ).fetchone()
    assert prices is not None
    # What the gateway priced in Python: about four bytes a token, and the answer at max_tokens.
    expected = ((Decimal(1236) / 4) * prices[0] + 200 * prices[1]) / Decimal(10**6)
    row = conn.execute(PRICED_MATCH, (LLAMA8, key, 1236, 200)).fetchone()
    assert row is not None and row[1] is not None and row[2] is None
    assert held(conn, key) == round(expected, 8) == Decimal("0.00003545")
    job = conn.execute("select reserved_usd from jobs where id = %s", (row[0],)).fetchone()
    assert job == (round(expected, 8),)
    # A model the catalog does not know holds nothing; the job still runs on the node that has it.
    row = conn.execute(PRICED_MATCH, ("acme/uncatalogued-7b", key, 10_000, 1000)).fetchone()
    assert row is not None and row[1] is not None
    assert held(conn, key) == round(expected, 8)
    # Ending the job gives its hold back, as with a hold given in USD.
    conn.execute("select complete_job(%s, 'succeeded', 0, 0)", (row[0],))
    conn.execute("select complete_job(jobs.id, 'succeeded', 0, 0) from jobs where model_id = %s", (LLAMA8,))
    assert held(conn, key) == 0
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="must not be negative"):
        conn.execute(PRICED_MATCH, (LLAMA8, key, -1, 200))
    # The earlier overload is still there for gateways that price the hold themselves.
    row = conn.execute(
        "select node_id from match_job(%s, %s, p_reserve_usd => 0.5)", (LLAMA8, key)
    ).fetchone()
    assert row is not None and row[0] is not None and held(conn, key) == Decimal("0.5")


def test_a_single_request_can_never_cost_more_than_the_budget_left(conn: psycopg.Connection) -> None:
    """The review's case: a fresh $0.01 key asking for 1,000,000 tokens was admitted and charged $0.10.
    The answer is now capped at what the budget pays for, the hold is exactly that, and the node is
    told (max_output_tokens comes back for the gateway to send as max_tokens)."""
    make_node(conn, max_concurrency=8)
    key = make_key(conn, budget_usd=0.01)
    (price,) = conn.execute("select output_usd_per_mtok from models where id = %s", (LLAMA8,)).fetchone() or (
        0,
    )
    capped = conn.execute(
        "select node_id, max_output_tokens from match_job(%s, %s, 'balanced', null, null, null, null, null,"
        " false, 3, 0, 1000000)",
        (LLAMA8, key),
    ).fetchone()
    assert capped is not None and capped[0] is not None
    assert capped[1] == int(Decimal("0.01") * 10**6 / price) < 1_000_000
    assert held(conn, key) <= Decimal("0.01")
    # Charged for every token it was allowed, the key is spent to the cent and no further.
    (job,) = conn.execute("select id from jobs where api_key_id = %s", (key,)).fetchone() or (None,)
    conn.execute("select complete_job(%s, 'succeeded', 0, %s)", (job, capped[1]))
    (spent,) = conn.execute("select spent_usd from api_keys where id = %s", (key,)).fetchone() or (None,)
    assert spent <= Decimal("0.01")
    # Nothing left to pay for even one token: refused before any node is claimed.
    with pytest.raises(psycopg.Error, match="cannot cover") as refused:
        conn.execute(PRICED_MATCH, (LLAMA8, key, 0, 10))
    assert refused.value.sqlstate == "NG402"
    assert conn.execute("select count(*) from jobs where api_key_id = %s", (key,)).fetchone() == (1,)


def test_a_charge_never_takes_a_key_past_its_budget(conn: psycopg.Connection) -> None:
    """A review's case: a hold assumes four bytes a prompt token, and a prompt of digits runs near one
    (1,912 bytes, 1,830 tokens). Two such requests placed together on a nearly spent key were each
    charged 3.8 times their hold, and the key ended at 1.27 times its budget. The ending that would
    cross the budget is now charged what is left of it, in a batch or one by one."""
    make_node(conn, max_concurrency=8)
    for batched in (True, False):
        key = make_key(conn, budget_usd=0.0001)
        jobs = [conn.execute(PRICED_MATCH, (LLAMA8, key, 1912, 10)).fetchone() for _ in range(3)]
        assert all(job is not None and job[1] is not None for job in jobs)
        ids = [job[0] for job in jobs if job is not None]
        if batched:
            conn.execute(
                "select complete_jobs(%s, '{succeeded,succeeded,succeeded}', '{1830,1830,1830}', '{10,10,10}',"
                " '{null,null,null}', '{100,100,100}', '{null,null,null}')",
                (ids,),
            )
        else:
            for job in ids:
                conn.execute("select complete_job(%s, 'succeeded', 1830, 10)", (job,))
        spent, reserved = conn.execute(
            "select spent_usd, reserved_usd from api_keys where id = %s", (key,)
        ).fetchone() or (None, None)
        costs = [row[0] for row in conn.execute("select cost_usd from jobs where id = any(%s)", (ids,))]
        assert spent == sum(costs) == Decimal("0.0001") and reserved == 0, (batched, spent, costs)
        # Together: the first in full ($0.0000925), the second what is left, the third nothing. One
        # by one, each leaves the others' holds ($0.0000249 each) in place while they run.
        expected = ["0", "0.0000075", "0.0000925"] if batched else ["0.0000249", "0.0000249", "0.0000502"]
        assert sorted(costs) == [Decimal(c) for c in expected], costs


def test_a_job_that_used_no_token_costs_no_node_time(conn: psycopg.Connection) -> None:
    """A model priced by the node's time charged a job the node refused (its own 400, no token) for
    the moment it took, and one the node failed for the time it failed. Both are free; an answer,
    a job that used tokens, or one whose client left, pays the node's time."""
    uncatalogued = "acme/uncatalogued-7b"
    make_node(conn, models={uncatalogued: "loaded"}, max_concurrency=2, hourly_rate=3.6)
    key = make_key(conn, budget_usd=1.0)
    refused = "HTTP 400 from the node: b'prompt too long'"
    ends = [
        ("cancelled", 0, refused),
        ("cancelled", 0, "the client disconnected"),
        ("cancelled", 5, "the client disconnected"),
        ("succeeded", 5, None),
        ("succeeded", 0, None),
        ("failed", 0, "timeout: the node sent nothing in time"),
    ]
    costs = []
    for status, tokens, error in ends:
        row = conn.execute(PRICED_MATCH, (uncatalogued, key, 100, 10)).fetchone()
        assert row is not None and row[1] is not None
        (cost,) = conn.execute(
            "select cost_usd from complete_job(%s, %s, %s, %s, null, 5000, %s)",
            (row[0], status, tokens, tokens, error),
        ).fetchone() or (None,)
        costs.append(cost)
    slot = Decimal("0.0025")  # $3.60/h over 2 slots, for 5 s
    assert costs == [0, slot, slot, slot, slot, 0]


def test_requests_the_budget_pays_for_are_not_capped(conn: psycopg.Connection) -> None:
    make_node(conn, max_concurrency=8)
    for key in (make_key(conn, budget_usd=100.0), make_key(conn)):
        row = conn.execute(
            "select max_output_tokens from match_job(%s, %s, 'balanced', null, null, null, null, null,"
            " false, 3, 400, 512)",
            (LLAMA8, key),
        ).fetchone()
        assert row == (512,)


# One sweep ------------------------------------------------------------------------------------------


def test_one_sweep_takes_silent_nodes_offline_and_ends_abandoned_jobs(conn: psycopg.Connection) -> None:
    past_the_restart(conn)  # found so: it passed only after other tests
    busy = make_node(conn, "busy")
    key = make_key(conn, budget_usd=1.0)
    job = match(conn, key)
    conn.execute("update jobs set created_at = now() - interval '2 hours' where id = %s", (job,))
    silent = make_node(conn, "silent")
    conn.execute("update nodes set last_heartbeat_at = now() - interval '1 minute' where id = %s", (silent,))

    swept = conn.execute("select kind, id, name from sweep() order by kind").fetchall()
    assert swept == [("job_abandoned", job, None), ("node_offline", silent, "silent")]
    assert conn.execute("select status from nodes where id = %s", (silent,)).fetchone() == ("offline",)
    assert conn.execute("select status, inflight from nodes where id = %s", (busy,)).fetchone() == (
        "online",
        0,
    )
    assert conn.execute("select status from jobs where id = %s", (job,)).fetchone() == ("failed",)
    assert conn.execute("select count(*) from sweep()").fetchone() == (0,)  # nothing left to sweep


@pytest.mark.parametrize(
    ("table", "states"),
    [
        ("nodes", get_args(NodeStatus)),
        ("jobs", get_args(JobStatus)),
        ("job_attempts", get_args(JobStatus)),
    ],
)
def test_python_states_are_the_ones_the_tables_allow(
    conn: psycopg.Connection, table: str, states: tuple[str, ...]
) -> None:
    (definition,) = conn.execute(
        "select pg_get_constraintdef(oid) from pg_constraint"
        " where conrelid = %s::regclass and contype = 'c' and pg_get_constraintdef(oid) ~ '\\(status = ANY'",
        (f"public.{table}",),
    ).fetchone() or (None,)
    assert definition is not None, f"no status constraint on {table}"
    assert sorted(re.findall(r"'(\w+)'::text", definition)) == sorted(states)
    assert set(get_args(JobOutcome)) == set(get_args(JobStatus)) - {"running"}
