"""Earnings in SQL: a ledger row per paid job written as the job succeeds (exactly once, gross equal to
what its key was charged, the platform's fee and the owner's share), read by the node's owner only;
an owner's earnings per day, node and model, totals, and node stats (uptime from recorded status
changes, jobs served, reputation, warm models)."""

from __future__ import annotations

import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from neuralgrid.db import migrate
from neuralgrid.db.embedded import EmbeddedPostgres
from tests.conftest import LLAMA8, make_key, make_node, make_user
from tests.db.test_rls import acting_as, denied

QWEN = "Qwen/Qwen2.5-32B-Instruct-AWQ"  # 24 GB, like LLAMA8
MIGRATION = "20261128000200_earnings.sql"
LEDGER = "select node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd from earnings where job_id = %s"


def run_job(
    conn: psycopg.Connection,
    key: uuid.UUID | None,
    *,
    model: str = LLAMA8,
    status: str = "succeeded",
    prompt: int = 1000,
    completion: int = 90,
) -> uuid.UUID:
    """A job placed by match_job() and ended by complete_job(), as the gateway does."""
    row = conn.execute("select job_id, node_id from match_job(%s, %s)", (model, key)).fetchone()
    assert row is not None and row[1] is not None, "no node took the job"
    conn.execute(
        "select complete_job(%s, %s, %s, %s, null, 100, %s)",
        (row[0], status, prompt, completion, None if status == "succeeded" else "boom"),
    )
    return uuid.UUID(str(row[0]))


def spent(conn: psycopg.Connection, key: uuid.UUID) -> Decimal:
    row = conn.execute("select spent_usd from api_keys where id = %s", (key,)).fetchone()
    assert row is not None
    return Decimal(row[0])


def ledger_rows(conn: psycopg.Connection) -> int:
    row = conn.execute("select count(*) from earnings").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def owners(conn: psycopg.Connection) -> dict[str, uuid.UUID]:
    """Alice owns two nodes (the only ones holding LLAMA8 and QWEN), Bob one; a developer's key pays."""
    alice, bob = make_user(conn, "alice@example.test"), make_user(conn, "bob@example.test")
    return {
        "alice": alice,
        "bob": bob,
        "alice_a": make_node(conn, "alice-a", owner_id=alice, models={LLAMA8: "loaded", QWEN: "available"}),
        "alice_b": make_node(conn, "alice-b", owner_id=alice, status="offline", models={QWEN: "loaded"}),
        "bob_node": make_node(conn, "bob-node", owner_id=bob, status="offline"),
        "key": make_key(conn, budget_usd=10.0),
    }


# The ledger ------------------------------------------------------------------------------------------


def test_a_succeeded_job_earns_its_charge_less_the_fee_exactly_once(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    before = spent(conn, owners["key"])
    job = run_job(conn, owners["key"])
    charged = spent(conn, owners["key"]) - before
    assert charged == Decimal("0.00005900")  # 1000 x $0.05 + 90 x $0.10 per million
    row = conn.execute(LEDGER, (job,)).fetchone()
    assert row == (
        owners["alice_a"],
        owners["alice"],
        LLAMA8,
        charged,
        Decimal("0.1500"),
        Decimal("0.00000885"),
        Decimal("0.00005015"),
    )
    assert conn.execute("select cost_usd from jobs where id = %s", (job,)).fetchone() == (charged,)

    # Ended again: refused (not running), and the ledger is unchanged.
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        conn.execute("select complete_job(%s)", (job,))
    conn.execute(
        "select complete_jobs(array[%s]::uuid[], '{succeeded}', '{5}', '{5}', '{null}', '{1}', '{null}')",
        (job,),
    )
    # Even a job forced back to running and completed a second time earns once (the unique key).
    conn.execute("update jobs set status = 'running', finished_at = null where id = %s", (job,))
    conn.execute(
        "insert into job_attempts (job_id, attempt, node_id) values (%s, 2, %s)", (job, owners["alice_a"])
    )
    conn.execute("select complete_job(%s, 'succeeded', 5000, 5000)", (job,))
    assert ledger_rows(conn) == 1
    assert conn.execute(LEDGER, (job,)).fetchone() == row


def test_a_job_whose_client_left_earns_what_it_was_charged(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    """A client that leaves mid-answer is charged what the node did, and the node's owner earns it (a
    review found the key charged and the owner paid nothing). One that left before any token pays
    nothing, and earns nobody anything."""
    left = run_job(conn, owners["key"], status="cancelled", prompt=1000, completion=4)
    (charged,) = conn.execute("select cost_usd from jobs where id = %s", (left,)).fetchone() or (None,)
    assert charged == Decimal("0.00005040")
    assert conn.execute("select gross_usd, net_usd from earnings where job_id = %s", (left,)).fetchone() == (
        charged,
        Decimal("0.00004284"),
    )
    run_job(conn, owners["key"], status="cancelled", prompt=0, completion=0)
    assert ledger_rows(conn) == 1


def test_failed_abandoned_rejected_and_unpaid_jobs_earn_nothing(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    key = owners["key"]
    # Abandoned: the sweeper ends it as failed.
    (abandoned,) = conn.execute("select job_id from match_job(%s, %s)", (LLAMA8, key)).fetchone() or (None,)
    conn.execute("update jobs set created_at = now() - interval '2 hours' where id = %s", (abandoned,))
    conn.execute("select sweep_stale_jobs()")
    # Rejected: the request's fault, cancelled.
    (rejected,) = conn.execute("select job_id from match_job(%s, %s)", (LLAMA8, key)).fetchone() or (None,)
    conn.execute("select reject_job(%s, 'bad request')", (rejected,))
    # No key paid for it: nobody was charged, so there is nothing to share.
    run_job(conn, None)
    # Failed (last: it cools its node down): charged for its tokens, earning nothing.
    failed = run_job(conn, key, status="failed")
    assert conn.execute("select cost_usd > 0 from jobs where id = %s", (failed,)).fetchone() == (True,)
    assert ledger_rows(conn) == 0
    assert conn.execute("select count(*) from jobs where status <> 'running'").fetchone() == (4,)


def test_a_batch_earns_per_job_and_the_owner_of_each_node(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    conn.execute("update nodes set status = 'online' where id = %s", (owners["bob_node"],))
    jobs = [
        conn.execute("select job_id from match_job(%s, %s)", (LLAMA8, owners["key"])).fetchone()
        for _ in range(6)
    ]
    ids = [row[0] for row in jobs if row]
    statuses = ["succeeded", "failed", "succeeded", "succeeded", "cancelled", "succeeded"]
    before = spent(conn, owners["key"])
    with conn.transaction():
        conn.execute("set local track_functions = 'pl'")
        conn.execute(
            "select complete_jobs(%s::uuid[], %s::text[], %s::int[], %s::int[], %s::real[], %s::real[], %s::text[])",
            (ids, statuses, [1000] * 6, [90] * 6, [None] * 6, [100.0] * 6, [None] * 6),
        )
        calls = conn.execute(
            "select pg_stat_get_xact_function_calls('private.record_earning'::regproc)"
        ).fetchone()
    assert calls == (1,)  # one insert for the batch (a call a job was 12% of a leased job's CPU)
    charged_succeeded = conn.execute(  # and the one its client left, after the node's work
        "select sum(cost_usd) from jobs where id = any(%s) and status <> 'failed'", (ids,)
    ).fetchone()
    assert ledger_rows(conn) == 5
    ledger = conn.execute(
        "select sum(gross_usd), sum(fee_usd + net_usd), count(distinct owner_id) from earnings"
    ).fetchone()
    assert ledger is not None and charged_succeeded is not None
    assert ledger[0] == ledger[1] == charged_succeeded[0]
    assert spent(conn, owners["key"]) - before == Decimal("0.00005900") * 6  # failed jobs are charged too
    owners_by_node = conn.execute(
        "select count(*) from earnings e join nodes n on n.id = e.node_id where n.owner_id <> e.owner_id"
    ).fetchone()
    assert owners_by_node == (0,)


def test_the_fee_rate_is_a_setting_kept_per_row_and_bounded(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    first = run_job(conn, owners["key"])
    conn.execute("update platform_settings set platform_fee_rate = 0.2")
    second = run_job(conn, owners["key"])
    rows: dict[uuid.UUID, str] = dict(
        conn.execute(
            "select job_id, (fee_rate, fee_usd, net_usd)::text from earnings where job_id = any(%s)",
            ([first, second],),
        ).fetchall()
    )
    assert rows == {first: "(0.1500,0.00000885,0.00005015)", second: "(0.2000,0.00001180,0.00004720)"}
    conn.execute("update platform_settings set platform_fee_rate = 0")
    free = run_job(conn, owners["key"])
    assert conn.execute("select fee_usd, net_usd from earnings where job_id = %s", (free,)).fetchone() == (
        Decimal(0),
        Decimal("0.00005900"),
    )
    for bad in (1, 1.5, -0.01, None):
        with pytest.raises((psycopg.errors.CheckViolation, psycopg.errors.NotNullViolation)):
            conn.execute("update platform_settings set platform_fee_rate = %s", (bad,))
    # The ledger keeps its arithmetic: net is gross less the fee, nothing negative.
    with pytest.raises(psycopg.errors.CheckViolation, match="net_usd is gross_usd less fee_usd"):
        conn.execute("update earnings set net_usd = net_usd + 1 where job_id = %s", (first,))
    with pytest.raises(psycopg.errors.CheckViolation, match="must not be negative"):
        conn.execute("update earnings set gross_usd = -1, net_usd = -1 - fee_usd where job_id = %s", (first,))


# Who reads and writes it -------------------------------------------------------------------------


def test_an_owner_reads_only_the_earnings_of_their_own_nodes(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    job = run_job(conn, owners["key"])
    conn.execute(
        "update nodes set status = case when id = %s then 'online' else 'offline' end", (owners["bob_node"],)
    )
    bobs = run_job(conn, owners["key"])
    with acting_as(conn, "authenticated", owners["alice"]) as c:
        assert c.execute("select job_id from earnings").fetchall() == [(job,)]
        assert denied(c, "update earnings set net_usd = 0")
        assert denied(c, "delete from earnings")
        assert denied(
            c,
            "insert into earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd)"
            " values (gen_random_uuid(), %s, %s, 'x', 1, 0, 0, 1)",
            (owners["alice_a"], owners["alice"]),
        )
    with acting_as(conn, "authenticated", owners["bob"]) as c:
        assert c.execute("select job_id from earnings").fetchall() == [(bobs,)]
        assert c.execute("select count(*) from my_earnings(null)").fetchone() == (1,)
    stranger = make_user(conn)
    with acting_as(conn, "authenticated", stranger) as c:
        assert c.execute("select count(*) from earnings").fetchone() == (0,)
        assert c.execute("select count(*) from my_earnings(null)").fetchone() == (0,)
        assert c.execute("select jobs, net_usd from my_earnings_totals(null)").fetchone() == (0, Decimal(0))
        assert c.execute("select count(*) from my_node_stats()").fetchone() == (0,)
        assert c.execute("select count(*) from node_status_changes").fetchone() == (0,)
    with acting_as(conn, "anon") as c:
        assert denied(c, "select * from earnings")
        assert denied(c, "select * from node_status_changes")
        assert denied(c, "select * from my_earnings(null)")
        assert denied(c, "select * from my_earnings_totals(null)")
        assert denied(c, "select * from my_node_stats()")
    with acting_as(conn, "service_role") as c:
        assert c.execute("select count(*) from earnings").fetchone() == (2,)
        c.execute("update earnings set model_id = model_id")


# What an owner sees ----------------------------------------------------------------------------------


def as_owner(
    conn: psycopg.Connection, owner: uuid.UUID, query: str, params: tuple[Any, ...] = ()
) -> list[Any]:
    with acting_as(conn, "authenticated", owner) as c:
        return c.execute(query, params).fetchall()


def test_earnings_per_day_node_and_model_and_their_totals(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    key = owners["key"]
    old = run_job(conn, key)
    conn.execute("update earnings set earned_at = now() - interval '3 days' where job_id = %s", (old,))
    run_job(conn, key)
    run_job(conn, key, model=QWEN, prompt=2000, completion=100)
    conn.execute("update nodes set status = 'offline' where id = %s", (owners["alice_a"],))
    conn.execute("update nodes set status = 'online' where id = %s", (owners["alice_b"],))
    run_job(conn, key, model=QWEN, prompt=2000, completion=100)
    days = [
        r[0]
        for r in conn.execute("select distinct (earned_at at time zone 'UTC')::date from earnings order by 1")
    ]
    rows = as_owner(
        conn,
        owners["alice"],
        "select day, node_name, model_id, jobs, gross_usd, fee_usd, net_usd from my_earnings(null)",
    )
    qwen = Decimal("0.00033000")  # 2000 x $0.15 + 100 x $0.30 per million
    llama = Decimal("0.00005900")
    assert sorted(rows) == sorted(
        [
            (days[0], "alice-a", LLAMA8, 1, llama, Decimal("0.00000885"), Decimal("0.00005015")),
            (days[1], "alice-a", QWEN, 1, qwen, Decimal("0.00004950"), Decimal("0.00028050")),
            (days[1], "alice-a", LLAMA8, 1, llama, Decimal("0.00000885"), Decimal("0.00005015")),
            (days[1], "alice-b", QWEN, 1, qwen, Decimal("0.00004950"), Decimal("0.00028050")),
        ]
    )
    recent = as_owner(conn, owners["alice"], "select count(*) from my_earnings(now() - interval '1 day')")
    assert recent == [(3,)]
    totals = as_owner(
        conn,
        owners["alice"],
        "select jobs, gross_usd, fee_usd, net_usd from my_earnings_totals(now() - interval '1 day')",
    )
    assert totals == [(3, 2 * qwen + llama, Decimal("0.00010785"), 2 * qwen + llama - Decimal("0.00010785"))]
    # A deleted node's earnings stay its owner's, under its id, without its name.
    conn.execute("delete from nodes where id = %s", (owners["alice_b"],))
    gone = as_owner(
        conn,
        owners["alice"],
        "select node_id, node_name, net_usd from my_earnings(null) where node_id = %s",
        (owners["alice_b"],),
    )
    assert gone == [(owners["alice_b"], None, Decimal("0.00028050"))]


def test_status_changes_are_recorded_except_between_online_and_busy(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    node = owners["alice_a"]
    history = "select status from node_status_changes where node_id = %s order by changed_at, id"
    assert [r[0] for r in conn.execute(history, (node,))] == ["online"]
    for status in ("busy", "online", "busy", "offline", "offline", "online", "draining", "offline"):
        conn.execute("update nodes set status = %s where id = %s", (status, node))
    assert [r[0] for r in conn.execute(history, (node,))] == ["online", "offline", "online", "draining"]


def set_history(conn: psycopg.Connection, node: uuid.UUID, *changes: tuple[str, str]) -> None:
    """Replaces a node's recorded status changes by (status, how long ago) pairs."""
    conn.execute("delete from node_status_changes where node_id = %s", (node,))
    for status, ago in changes:
        conn.execute(
            "insert into node_status_changes (node_id, status, changed_at) values (%s, %s, now() - %s::interval)",
            (node, status, ago),
        )


def test_node_stats_uptime_jobs_reputation_and_warm_models(
    conn: psycopg.Connection, owners: dict[str, uuid.UUID]
) -> None:
    a, b = owners["alice_a"], owners["alice_b"]
    run_job(conn, owners["key"])
    run_job(conn, owners["key"], status="failed")
    # a: recorded since 10 days ago; in the last 7 days offline for the day from 5 to 4 days ago.
    set_history(conn, a, ("online", "10 days"), ("offline", "5 days"), ("online", "4 days"))
    # b: recorded only for the last 2 hours, up (busy) the first of them, offline since.
    set_history(conn, b, ("busy", "2 hours"), ("offline", "1 hour"))
    rows = as_owner(
        conn,
        owners["alice"],
        "select name, status, round(uptime::numeric, 4), round(observed_s), jobs_served, failures,"
        " round(reputation::numeric, 4), warm_models from my_node_stats()",
    )
    assert rows == [
        ("alice-a", "online", Decimal("0.8571"), 7 * 86400, 1, 1, Decimal("0.5000"), [LLAMA8]),
        ("alice-b", "offline", Decimal("0.5000"), 7200, 0, 0, Decimal("0.5000"), [QWEN]),
    ]
    one_day = as_owner(
        conn, owners["alice"], "select round(uptime::numeric, 4) from my_node_stats(interval '1 day')"
    )
    assert one_day == [(Decimal("1.0000"),), (Decimal("0.5000"),)]
    # The reputation is the matcher's (the balanced policy's reputation component).
    conn.execute("update nodes set successes = 40, failures = 3, speed_ratio = 0.1 where id = %s", (a,))
    ours = as_owner(conn, owners["alice"], "select reputation from my_node_stats() where node_id = %s", (a,))
    matcher = conn.execute(
        "select reputation from private.node_components where node_id = %s and policy = 'balanced' limit 1",
        (a,),
    ).fetchone()
    assert matcher is not None and ours == [(pytest.approx(matcher[0]),)]
    # A node with nothing recorded yet has no uptime to show.
    set_history(conn, b)
    assert as_owner(
        conn, owners["alice"], "select uptime, observed_s from my_node_stats() where node_id = %s", (b,)
    ) == [(None, 0)]


def test_nodes_registered_before_the_migration_start_their_history_with_it(
    pg_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    """Uptime counts from the migration for the nodes that were there already: one row each, now."""
    earlier = tmp_path / "migrations"
    earlier.mkdir()
    for path in sorted(migrate.default_migrations_dir().glob("*.sql")):
        if path.name < MIGRATION:
            (earlier / path.name).write_text(path.read_text())
    url = pg_server.url(clone_database_named(pg_server, "earnings_seed"))
    with psycopg.connect(url, autocommit=True) as c:
        migrate.apply_compat_layer(c)
        migrate.migrate(c, earlier)
        old = make_node(c, "registered-before", status="draining")
        assert c.execute("select to_regclass('public.node_status_changes')").fetchone() == (None,)
        migrate.migrate(c)
        rows = c.execute("select status from node_status_changes where node_id = %s", (old,)).fetchall()
        assert rows == [("draining",)]
        assert c.execute("select platform_fee_rate from platform_settings").fetchone() == (Decimal("0.1500"),)


def clone_database_named(server: EmbeddedPostgres, name: str) -> str:
    with psycopg.connect(server.url(), autocommit=True) as c:
        c.execute(sql.SQL("drop database if exists {}").format(sql.Identifier(name)))
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    return name
