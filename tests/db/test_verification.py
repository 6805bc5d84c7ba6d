"""Model verification in SQL (075_verification.sql): which (node, model)s are under verification,
the sequential test and its states, the hard filter in the matcher and the leases, held and forfeited
earnings, challenges due and placed, an owner's view and a new verification, and bad input."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg
import pytest

from tests.conftest import LLAMA8, make_key, make_node, make_user
from tests.db.test_rls import acting_as

SHA = "a" * 64
QWEN = "Qwen/Qwen2.5-32B-Instruct-AWQ"


def pin(conn: psycopg.Connection, model: str = LLAMA8, sha: str = SHA) -> None:
    conn.execute(
        "insert into model_artifacts (model_id, format, sha256) values (%s, 'gguf', %s)", (model, sha)
    )


def record(conn: psycopg.Connection, node: uuid.UUID, *passed: bool, model: str = LLAMA8) -> list[Any]:
    """Each outcome in its own call, as gateways send them; the last call's rows."""
    rows: list[Any] = []
    for ok in passed:
        result = {
            "node": str(node),
            "model": model,
            "job": None,
            "passed": ok,
            "distance": 0 if ok else 9.5,
            "detail": {} if ok else {"reason": "token 3 is 9.5 logits below the best"},
        }
        rows = conn.execute("select * from record_challenges(%s::jsonb)", (json.dumps([result]),)).fetchall()
    return rows


def check(conn: psycopg.Connection, node: uuid.UUID, model: str = LLAMA8) -> dict[str, Any]:
    row = conn.execute(
        "select state, evidence, challenges, failures, last_failure from model_checks where node_id = %s and model_id = %s",
        (node, model),
    ).fetchone()
    assert row is not None, "not under verification"
    return dict(zip(("state", "evidence", "challenges", "failures", "last_failure"), row, strict=True))


def ranked(conn: psycopg.Connection, model: str = LLAMA8, **kw: Any) -> list[uuid.UUID]:
    limit = kw.get("limit", 10)
    return [r[0] for r in conn.execute("select node_id from score_nodes(%s, p_limit => %s)", (model, limit))]


# Under verification --------------------------------------------------------------------------------


def test_a_node_holding_a_pinned_model_is_under_verification_and_others_are_not(
    conn: psycopg.Connection,
) -> None:
    before = make_node(conn, "before", models={LLAMA8: "loaded", QWEN: "loaded"})
    pin(conn)  # pinned after the node listed it
    after = make_node(conn, "after", models={LLAMA8: "available"})
    assert check(conn, before)["state"] == "unverified"
    assert check(conn, after) == {
        "state": "unverified",
        "evidence": 0,
        "challenges": 0,
        "failures": 0,
        "last_failure": None,
    }
    assert conn.execute("select count(*) from model_checks where model_id = %s", (QWEN,)).fetchone() == (0,)


def test_a_pinned_artifact_must_name_its_bytes(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="sha256"):
        pin(conn, sha="not-a-hash")
    with pytest.raises(psycopg.errors.CheckViolation, match="repository"):
        conn.execute(
            "insert into model_artifacts (model_id, format, repository) values (%s, 'hf', 'x/y')", (LLAMA8,)
        )
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        pin(conn, model="no/such-model")


# The sequential test ---------------------------------------------------------------------------------


def test_two_failures_in_a_row_fail_a_node_and_the_first_makes_it_suspect(conn: psycopg.Connection) -> None:
    pin(conn)
    node = make_node(conn, models={LLAMA8: "loaded"})
    assert record(conn, node, False)[0][2] == "suspect"
    assert record(conn, node, False)[0][2] == "failed"
    got = check(conn, node)
    assert (got["challenges"], got["failures"]) == (2, 2)
    assert got["last_failure"] == "token 3 is 9.5 logits below the best"
    evidence = conn.execute(
        "select passed, distance, state from model_challenges where node_id = %s order by id", (node,)
    ).fetchall()
    assert evidence == [(False, 9.5, "suspect"), (False, 9.5, "failed")]
    # Failed is final until the owner asks again: later outcomes are ignored.
    assert record(conn, node, True) == []
    assert check(conn, node)["state"] == "failed"


def test_seven_passes_verify_a_node_and_a_long_record_buys_no_credit(conn: psycopg.Connection) -> None:
    pin(conn)
    node = make_node(conn, models={LLAMA8: "loaded"})
    record(conn, node, *[True] * 6)
    assert check(conn, node)["state"] == "unverified"
    record(conn, node, True)
    assert check(conn, node)["state"] == "verified"
    # A hundred more passes later, three failures still fail it: the evidence has a floor.
    record(conn, node, *[True] * 100)
    floor = check(conn, node)["evidence"]
    assert floor == pytest.approx(-4.6, abs=0.01)
    assert record(conn, node, False)[0][2] == "suspect"
    record(conn, node, False)
    assert check(conn, node)["state"] == "suspect"
    record(conn, node, False)
    assert check(conn, node)["state"] == "failed"


def test_a_cheat_that_passes_now_and_then_still_fails(conn: psycopg.Connection) -> None:
    pin(conn)
    node = make_node(conn, models={LLAMA8: "loaded"})
    record(conn, node, False, True, False)  # +3.91 - 0.68 + 3.91 = 7.14
    assert check(conn, node)["state"] == "failed"


def test_a_suspect_that_passes_again_is_verified_again(conn: psycopg.Connection) -> None:
    pin(conn)
    node = make_node(conn, models={LLAMA8: "loaded"})
    record(conn, node, *[True] * 7, False)
    assert check(conn, node)["state"] == "suspect"
    record(conn, node, *[True] * 5)
    assert check(conn, node)["state"] == "suspect"
    record(conn, node, True)
    assert check(conn, node)["state"] == "verified"


# Consequences ----------------------------------------------------------------------------------------


def test_a_failed_model_is_a_hard_filter_of_the_matcher_and_the_leases(conn: psycopg.Connection) -> None:
    pin(conn)
    cheat = make_node(conn, "cheat", hourly_rate=0.05, models={LLAMA8: "loaded", QWEN: "loaded"})
    honest = make_node(conn, "honest", hourly_rate=0.9, models={LLAMA8: "loaded"})
    assert ranked(conn)[0] == cheat  # the cheaper one, while nothing is known
    record(conn, cheat, False, False)
    assert ranked(conn) == [honest]
    assert cheat in ranked(conn, QWEN)  # only the model it failed
    explained: dict[UUID, str | None] = dict(
        conn.execute(
            "select node_id, reject_reason from score_nodes(%s, p_policy => 'seed', p_explain => true)",
            (LLAMA8,),
        ).fetchall()
    )
    assert explained[cheat] == f"failed verification of {LLAMA8}" and explained[honest] is None
    for _ in range(8):  # and no job is placed on it, however many come
        row = conn.execute("select node_id from match_job(%s)", (LLAMA8,)).fetchone()
        assert row is not None and row[0] == honest
        conn.execute("update nodes set inflight = 0, status = 'online' where id = %s", (honest,))
    gateway = uuid.uuid4()
    leases = conn.execute(
        "select node_id, slots from renew_leases(%s, %s::jsonb)",
        (gateway, json.dumps([{"model": LLAMA8, "want": 8, "in_use": {}}])),
    ).fetchall()
    assert cheat not in {node for node, _ in leases} and honest in {node for node, _ in leases}


def test_a_failure_forfeits_the_earnings_not_yet_settled(conn: psycopg.Connection) -> None:
    pin(conn)
    owner = make_user(conn)
    node = make_node(conn, owner_id=owner, models={LLAMA8: "loaded", QWEN: "loaded"})
    key = make_key(conn, budget_usd=10.0)

    def earn(model: str) -> uuid.UUID:
        row = conn.execute("select job_id from match_job(%s, %s)", (model, key)).fetchone()
        assert row is not None
        conn.execute("select complete_job(%s, 'succeeded', 1000, 100)", (row[0],))
        return uuid.UUID(str(row[0]))

    settled, held, other = earn(LLAMA8), earn(LLAMA8), earn(QWEN)
    conn.execute("update earnings set settles_at = now() - interval '1 s' where job_id = %s", (settled,))
    with acting_as(conn, "authenticated", owner):
        before = conn.execute(
            "select net_usd, held_usd, forfeited_usd from my_earnings_totals(null)"
        ).fetchone()
    net_of: dict[UUID, Decimal] = dict(conn.execute("select job_id, net_usd from earnings").fetchall())
    assert before == (sum(net_of.values()), net_of[held] + net_of[other], 0)  # held but the one settled
    record(conn, node, False, False)
    forfeited: dict[UUID, bool] = dict(
        conn.execute("select job_id, forfeited_at is not null from earnings").fetchall()
    )
    assert forfeited == {settled: False, held: True, other: False}
    with acting_as(conn, "authenticated", owner):
        net, held_usd, lost = conn.execute(
            "select net_usd, held_usd, forfeited_usd from my_earnings_totals(null)"
        ).fetchone()  # type: ignore[misc]
        mine = conn.execute(
            "select model_id, state, held_usd, forfeited_usd from my_model_checks()"
        ).fetchall()
        by_day = conn.execute("select sum(net_usd) from my_earnings(null)").fetchone()
    assert net == net_of[settled] + net_of[other] == (by_day or [None])[0]
    assert held_usd == net_of[other] and lost == net_of[held]
    assert mine == [(LLAMA8, "failed", Decimal(0), net_of[held])]


def test_an_owner_asks_again_for_a_failed_model_and_only_a_failed_one(conn: psycopg.Connection) -> None:
    pin(conn)
    pin(conn, QWEN, "b" * 64)
    owner, stranger = make_user(conn), make_user(conn)
    node = make_node(conn, owner_id=owner, models={LLAMA8: "loaded", QWEN: "loaded"})
    record(conn, node, False, False)
    record(conn, node, False, model=QWEN)
    with acting_as(conn, "authenticated", owner):  # not within the hour it failed
        assert conn.execute("select * from request_verification(%s)", (node,)).fetchall() == []
    conn.execute(
        "update model_checks set state_since = now() - interval '61 minutes' where node_id = %s", (node,)
    )
    with acting_as(conn, "authenticated", stranger), pytest.raises(psycopg.errors.NoDataFound):
        conn.execute("select * from request_verification(%s)", (node,))
    with acting_as(conn, "authenticated", owner):
        reset = conn.execute("select * from request_verification(%s)", (node,)).fetchall()
        assert reset == [(LLAMA8, "unverified")]
        assert check(conn, node)["evidence"] == 0 and check(conn, node, QWEN)["state"] == "suspect"
    conn.execute("select * from request_verification(%s)", (node,))  # as the service: the same
    assert check(conn, node)["state"] == "unverified"
    assert node in ranked(conn)


# Challenges due and placed ----------------------------------------------------------------------------


def test_due_challenges_are_those_the_referee_can_score_and_each_is_given_a_later_time(
    conn: psycopg.Connection,
) -> None:
    pin(conn)
    pin(conn, QWEN, "b" * 64)
    online = make_node(conn, models={LLAMA8: "loaded", QWEN: "loaded"})
    make_node(conn, status="offline", models={LLAMA8: "loaded"})
    failed = make_node(conn, models={LLAMA8: "loaded"})
    record(conn, failed, False, False)
    due = conn.execute(
        "select node_id, model_id, sha256, state from due_challenges(%s, 10)", ([SHA],)
    ).fetchall()
    assert due == [(online, LLAMA8, SHA, "unverified")]
    assert conn.execute("select count(*) from due_challenges(%s, 10)", ([SHA],)).fetchone() == (0,)
    wait = conn.execute(
        "select extract(epoch from next_challenge_at - now()) from model_checks where node_id = %s and model_id = %s",
        (online, LLAMA8),
    ).fetchone()
    assert wait is not None and 0 <= wait[0] <= 90  # within three means of 30 s
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="limit"):
        conn.execute("select * from due_challenges(%s, 0)", ([SHA],))


def test_due_cross_checks_are_the_others_each_with_peers_the_platforms_and_verified_first(
    conn: psycopg.Connection,
) -> None:
    pin(conn)  # a GGUF the referee holds: challenged against it, not cross-checked
    conn.execute(
        "insert into model_artifacts (model_id, format, repository, revision, dtype)"
        " values (%s, 'hf', 'Qwen/Qwen2.5-32B-Instruct-AWQ', %s, 'awq')",
        (QWEN, "c" * 40),
    )
    owner = make_user(conn)
    mine = make_node(conn, "mine", owner_id=owner, models={QWEN: "loaded", LLAMA8: "loaded"})
    platform = make_node(conn, "platform", models={QWEN: "loaded"})  # no owner: the platform's own
    verified = make_node(conn, "verified", owner_id=owner, models={QWEN: "loaded"})
    record(conn, verified, *[True] * 7, model=QWEN)
    failed = make_node(conn, "failed", owner_id=owner, models={QWEN: "loaded"})
    record(conn, failed, False, False, model=QWEN)
    conn.execute("update model_checks set next_challenge_at = 'infinity' where node_id <> %s", (mine,))
    due = conn.execute(
        "select node_id, model_id, state, peers from due_cross_checks(%s, 10)", ([SHA],)
    ).fetchall()
    assert due == [(mine, QWEN, "unverified", [platform, verified])]  # never a failed peer
    assert conn.execute("select count(*) from due_cross_checks(%s, 10)", ([SHA],)).fetchone() == (0,)
    # Without a referee, the GGUF's nodes are cross-checked too; one with no peer comes alone.
    conn.execute("update model_checks set next_challenge_at = now() where node_id = %s", (mine,))
    alone = conn.execute(
        "select model_id, peers from due_cross_checks('{}', 10) order by model_id"
    ).fetchall()
    assert alone == [(QWEN, [platform, verified]), (LLAMA8, [])]
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="limit"):
        conn.execute("select * from due_cross_checks(%s, 0)", ([SHA],))


def test_a_challenge_is_a_paid_job_on_exactly_its_node(conn: psycopg.Connection) -> None:
    pin(conn)
    owner = make_user(conn)
    node = make_node(conn, owner_id=owner, max_concurrency=1, models={LLAMA8: "loaded"})
    make_node(conn, "other", models={LLAMA8: "loaded"})
    gateway = uuid.uuid4()
    row = conn.execute(
        "select job_id, node_id from place_challenge(%s, %s, %s)", (str(gateway), node, LLAMA8)
    ).fetchone()
    assert row is not None and row[1] == node
    job = conn.execute("select gateway_id, api_key_id, status from jobs where id = %s", (row[0],)).fetchone()
    key = conn.execute("select private.challenge_key_id()").fetchone()
    assert job == (None, key[0] if key else None, "running")  # no gateway's: no renewal leases its slot
    # Full: no challenge placed, nothing recorded, no other node taken.
    assert (
        conn.execute("select * from place_challenge(%s, %s, %s)", (str(gateway), node, LLAMA8)).fetchall()
        == []
    )
    conn.execute("select complete_job(%s, 'succeeded', 100, 32)", (row[0],))
    earned = conn.execute(
        "select owner_id, net_usd > 0 from earnings where job_id = %s", (row[0],)
    ).fetchone()
    assert earned == (owner, True)


def test_bad_outcomes_are_refused_and_change_nothing(conn: psycopg.Connection) -> None:
    pin(conn)
    node = make_node(conn, models={LLAMA8: "loaded"})
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="JSON array"):
        conn.execute("select * from record_challenges('{}'::jsonb)")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="passed"):
        conn.execute(
            "select * from record_challenges(%s::jsonb)",
            (
                json.dumps(
                    [
                        {"node": str(node), "model": LLAMA8, "passed": False},
                        {"node": str(node), "model": LLAMA8},
                    ]
                ),
            ),
        )
    assert check(conn, node)["challenges"] == 0


def test_a_model_pinned_to_another_file_starts_every_node_over(conn: psycopg.Connection) -> None:
    pin(conn)
    verified, failed = make_node(conn, models={LLAMA8: "loaded"}), make_node(conn, models={LLAMA8: "loaded"})
    record(conn, verified, *[True] * 7)
    record(conn, failed, False, False)
    conn.execute("update model_artifacts set sha256 = %s where model_id = %s", ("e" * 64, LLAMA8))
    assert check(conn, verified)["state"] == check(conn, failed)["state"] == "unverified"
    assert set(ranked(conn)) == {verified, failed}  # the failed one back in the matcher


def test_what_a_failed_model_earns_later_is_forfeited_as_it_is_written(conn: psycopg.Connection) -> None:
    pin(conn)
    node = make_node(conn, models={LLAMA8: "loaded"})
    key = make_key(conn, budget_usd=10.0)
    row = conn.execute("select job_id from match_job(%s, %s)", (LLAMA8, key)).fetchone()
    assert row is not None
    record(conn, node, False, False)  # fails while the job runs
    conn.execute("select complete_job(%s, 'succeeded', 1000, 100)", (row[0],))
    assert conn.execute(
        "select forfeited_at is not null from earnings where job_id = %s", (row[0],)
    ).fetchone() == (True,)


def test_a_node_deleted_before_it_is_verified_forfeits_what_it_holds(conn: psycopg.Connection) -> None:
    pin(conn)
    pin(conn, QWEN, "b" * 64)
    owner = make_user(conn)
    node = make_node(conn, owner_id=owner, models={LLAMA8: "loaded", QWEN: "loaded"})
    key = make_key(conn, budget_usd=10.0)
    jobs = {}
    for model in (LLAMA8, QWEN):
        row = conn.execute("select job_id from match_job(%s, %s)", (model, key)).fetchone()
        assert row is not None
        conn.execute("select complete_job(%s, 'succeeded', 1000, 100)", (row[0],))
        jobs[model] = row[0]
    record(conn, node, *[True] * 7, model=QWEN)  # verified: its earnings settle as they would
    record(conn, node, False)  # LLAMA8 suspect: its owner deletes the node
    conn.execute("delete from nodes where id = %s", (node,))
    kept: dict[str, bool] = dict(
        conn.execute("select model_id, forfeited_at is null from earnings").fetchall()
    )
    assert kept == {LLAMA8: False, QWEN: True}
