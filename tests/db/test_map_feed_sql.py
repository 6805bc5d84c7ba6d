"""The map at any size in SQL (issue 41): the summary of the fleet (map_summary()), its broadcast on
map:summary at most once a second and only of what changed (private.send_map_summary()), a viewer's
box (map_view()) and the table a page at a time (node_list()), each as anon may call it."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from tests.conftest import LLAMA8, make_node, make_user

AMSTERDAM = (52.37, 4.9)  # tile 1013: latitude bucket 10, longitude bucket 13
TOKYO = (35.68, 139.7)  # tile 922


@contextmanager
def as_anon(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    with conn.transaction(force_rollback=True):
        conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps({"role": "anon"}),))
        conn.execute("set local role anon")
        yield conn


def value(conn: psycopg.Connection, query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def summary(conn: psycopg.Connection, cached: bool = False) -> dict[str, Any]:
    return dict(value(conn, "select public.map_summary(%s)", (cached,)))


def send(conn: psycopg.Connection) -> bool:
    """One call of the gateways' once-a-second feed, as if the last was a second ago."""
    conn.execute("update public.map_feed set checked_at = now() - interval '1 second'")
    return bool(value(conn, "select private.send_map_summary()"))


def sent(conn: psycopg.Connection) -> list[dict[str, Any]]:
    rows = conn.execute(
        "select event, private, payload from realtime.messages where topic = 'map:summary' order by inserted_at"
    ).fetchall()
    assert all(event == "summary" and private is False for event, private, _ in rows)
    return [payload for _, _, payload in rows]


@pytest.fixture
def fleet(conn: psycopg.Connection) -> dict[str, uuid.UUID]:
    owner = make_user(conn)
    return {
        "ams-1": make_node(conn, "ams-1", latitude=AMSTERDAM[0], longitude=AMSTERDAM[1], owner_id=owner),
        "ams-2": make_node(conn, "ams-2", latitude=52.1, longitude=5.1, status="busy", hourly_rate=0.2),
        "ams-3": make_node(conn, "ams-3", latitude=51.9, longitude=4.5, status="offline", hourly_rate=0.01),
        "tokyo": make_node(
            conn, "tokyo", latitude=TOKYO[0], longitude=TOKYO[1], region="ap-northeast", status="draining"
        ),
        "h100": make_node(
            conn, "h100", latitude=TOKYO[0], longitude=TOKYO[1], region="ap-northeast",
            gpu_model="NVIDIA H100 80GB HBM3", vram_gb=80, tflops=989, hourly_rate=2.5,
        ),
        "nowhere": make_node(conn, "nowhere", latitude=None, longitude=None, region="lab"),
    }  # fmt: skip


# The summary ------------------------------------------------------------------------------------------


def test_the_summary_counts_the_fleet_by_status_tile_region_and_gpu(
    conn: psycopg.Connection, fleet: dict[str, uuid.UUID]
) -> None:
    s = summary(conn)
    assert s["total"] == [3, 1, 1, 1]  # online, busy, draining, offline
    assert s["unplaced"] == [1, 0, 0, 0]
    assert s["tile_deg"] == 15 and "seq" not in s  # computed now, not the one sent
    ams, tokyo = s["tiles"]["1013"], s["tiles"]["922"]
    assert ams[2:] == [1, 1, 0, 1] and tokyo[2:] == [1, 0, 1, 0]
    # Where the tile's nodes stand: their mean position, not the tile's corner.
    assert ams[:2] == [pytest.approx((52.37 + 52.1 + 51.9) / 3, abs=0.01), pytest.approx(4.83, abs=0.01)]
    assert set(s["tiles"]) == {"1013", "922"}
    assert s["regions"] == {"eu-west": [1, 1, 0, 1], "ap-northeast": [1, 0, 1, 0], "lab": [1, 0, 0, 0]}
    assert s["gpus"]["NVIDIA H100 80GB HBM3"] == [1, 0, 0, 0, 2.5]
    # The cheapest online or busy card: not the offline one at $0.01.
    assert s["gpus"]["NVIDIA GeForce RTX 4090"] == [2, 1, 1, 1, 0.2]
    # The totals fleet_stats() gives, from the same pass.
    stats = conn.execute("select online_vram_gb, online_tflops from public.fleet_stats()").fetchone()
    assert (
        stats == (s["stats"]["online_vram_gb"], s["stats"]["online_tflops"]) == (24 * 3 + 80, 165 * 3 + 989)
    )
    assert s["stats"]["jobs_last_minute"] == 0


def test_an_empty_fleet_has_a_summary(conn: psycopg.Connection) -> None:
    s = summary(conn)
    assert s["total"] == [0, 0, 0, 0] and s["tiles"] == {} and s["gpus"] == {}
    assert s["stats"]["online_vram_gb"] == 0


def test_free_text_keeps_the_summary_small(conn: psycopg.Connection) -> None:
    """Regions and GPU models are whatever owners type: the 100 with most nodes are kept."""
    conn.execute(
        "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region)"
        " select 'n' || g, 'gpu ' || g, 24, 100, 0.3, 'region ' || g from generate_series(1, 150) g"
    )
    s = summary(conn)
    assert len(s["regions"]) == 100 and len(s["gpus"]) == 100
    assert s["total"] == [0, 0, 0, 150]
    assert len(json.dumps(s)) < 12_000


def test_the_planner_expects_a_group_a_tile_not_a_group_a_node(conn: psycopg.Connection) -> None:
    """At 100,000 nodes (bench map's fleet) the summary sorted the fleet, 150 ms, where a hash of its
    groups takes 40 ms: without the statistics object nodes_map_tile the planner splits the tile into
    latitude and longitude, nearly unique, and expects a group a node. The fleet is written without
    its triggers, as a restore would: the plan is the point."""
    conn.execute("select setseed(0.41)")
    conn.execute("set session_replication_role = replica")
    conn.execute(
        "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude, longitude,"
        " status) select 'n' || g, 'gpu ' || (g % 6), 24, 100, 0.3, 'r' || (g % 10), 40 + 20 * random(),"
        " 90 * random(), (array['online', 'busy', 'draining', 'offline'])[1 + g % 4]"
        " from generate_series(1, 100000) g"
    )
    conn.execute("set session_replication_role = origin")
    conn.execute("analyze public.nodes")
    (top, *_) = [
        row[0]
        for row in conn.execute(
            "explain select width_bucket(n.latitude, -90, 90, 12) * 100 + width_bucket(n.longitude, -180, 180, 24),"
            " n.status, n.region, n.gpu_model, count(*) from public.nodes n group by 1, n.status, n.region, n.gpu_model"
        )
    ]
    expected = int(re.search(r"rows=(\d+)", top)[1])  # type: ignore[index]
    assert top.startswith("HashAggregate") and expected < 5_000, top


# The broadcast ----------------------------------------------------------------------------------------


def test_the_first_summary_is_sent_whole_then_only_what_changed(
    conn: psycopg.Connection, fleet: dict[str, uuid.UUID]
) -> None:
    assert send(conn)
    (first,) = sent(conn)
    assert first["seq"] == 1 and first["full"] is True and first["total"] == [3, 1, 1, 1]
    assert set(first["tiles"]) == {"1013", "922"}
    # Nothing changed: nothing is sent, however often the gateways ask.
    assert not send(conn) and not send(conn)
    assert len(sent(conn)) == 1
    # Tokyo's H100 goes offline and Amsterdam's offline node is deleted.
    conn.execute("update public.nodes set status = 'offline' where id = %s", (fleet["h100"],))
    conn.execute("delete from public.nodes where id = %s", (fleet["ams-3"],))
    assert send(conn)
    second = sent(conn)[-1]
    assert second["seq"] == 2 and second["full"] is False
    assert second["total"] == [2, 1, 1, 1]
    assert second["tiles"] == {
        "922": [TOKYO[0], TOKYO[1], 0, 0, 1, 1],
        "1013": [pytest.approx(52.24, abs=0.01), pytest.approx(5.0, abs=0.01), 1, 1, 0, 0],
    }
    assert second["gpus"] == {
        "NVIDIA H100 80GB HBM3": [0, 0, 0, 1, None],
        "NVIDIA GeForce RTX 4090": [2, 1, 1, 0, 0.2],
    }
    assert second["regions"] == {"eu-west": [1, 1, 0, 0], "ap-northeast": [0, 0, 1, 1]}
    # A tile left empty is said gone (null); the feed keeps the whole summary, numbered.
    conn.execute("delete from public.nodes where name like 'ams-%%'")
    assert send(conn)
    assert sent(conn)[-1]["tiles"] == {"1013": None}
    kept = conn.execute("select seq, summary from public.map_feed").fetchone()
    assert kept is not None and kept[0] == 3 and kept[1]["seq"] == 3 and set(kept[1]["tiles"]) == {"922"}


def test_the_gateways_together_send_at_most_one_summary_a_second(
    conn: psycopg.Connection, db_url: str, fleet: dict[str, uuid.UUID]
) -> None:
    assert send(conn)
    conn.execute("update public.nodes set status = 'offline' where id = %s", (fleet["tokyo"],))
    # Every gateway asks every second; only one of them in 950 ms computes, whatever changed.
    assert not value(conn, "select private.send_map_summary()")
    conn.execute("update public.map_feed set checked_at = now() - interval '900 milliseconds'")
    assert not value(conn, "select private.send_map_summary()")
    # Two gateways at the same moment: the second waits on the first's row lock, then finds it checked.
    conn.execute("update public.map_feed set checked_at = now() - interval '1 second'")
    answers: list[bool] = []
    with psycopg.connect(db_url) as first:
        assert value(first, "select private.send_map_summary()")  # its transaction still open
        with psycopg.connect(db_url, autocommit=True) as second:
            waiting = threading.Thread(
                target=lambda: answers.append(value(second, "select private.send_map_summary()"))
            )
            waiting.start()
            waiting.join(0.5)
            assert waiting.is_alive()  # blocked on the row
            first.commit()
            waiting.join(5)
    assert answers == [False]
    assert [m["seq"] for m in sent(conn)] == [1, 2]


def computed_at(conn: psycopg.Connection) -> Any:
    return value(conn, "select computed_at from public.map_feed")


def settle(conn: psycopg.Connection) -> None:
    """As if the fleet had been at rest for 11 s, and counted 5 s ago."""
    conn.execute(
        "update public.map_feed set changed_at = now() - interval '11 seconds',"
        " computed_at = now() - interval '5 seconds'"
    )


def test_a_fleet_at_rest_is_not_counted_again(conn: psycopg.Connection, fleet: dict[str, uuid.UUID]) -> None:
    """bench map at 100,000 nodes: a viewer watching a fleet at rest cost Postgres some 40 ms of CPU a
    second, the summary counted again every second to find it unchanged. Now it is counted when what it
    counts changed lately (a sequence the nodes' statements move), the jobs' totals changed, or its last
    count is 30 s old."""
    assert send(conn)
    settle(conn)
    counted = computed_at(conn)
    assert not send(conn) and computed_at(conn) == counted  # not counted: nothing it counts moved
    # Load and heartbeats are not what it counts; nor a sweep every second that finds no silent node
    # (bench map: a statement trigger fired for its update of no row, and the fleet was counted again
    # every second); nor a status set to what it was.
    conn.execute(
        "update public.nodes set inflight = 1, gpu_utilization = 0.5 where id = %s", (fleet["ams-1"],)
    )
    conn.execute("select * from public.sweep()")
    conn.execute("update public.nodes set status = status")
    assert not send(conn) and computed_at(conn) == counted
    # A status is: counted, and sent.
    conn.execute("update public.nodes set status = 'draining' where id = %s", (fleet["ams-1"],))
    assert send(conn) and computed_at(conn) > counted
    assert sent(conn)[-1]["tiles"]["1013"][2:] == [0, 1, 1, 1]
    # For 10 s after a change the count goes on (a writer's nextval comes before its commit).
    assert not send(conn) and computed_at(conn) > counted
    # Inserts, deletes and truncates move it too; and the jobs' totals the summary carries.
    for statement in (
        "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region) values ('n', 'L4', 24, 1, 1, 'x')",
        "delete from public.nodes where name = 'n'",
        "update public.fleet_activity set jobs_last_minute = 7",
        "truncate public.nodes cascade",
    ):
        settle(conn)
        counted = computed_at(conn)
        conn.execute(statement)
        assert send(conn), statement
        assert computed_at(conn) > counted
    assert sent(conn)[-1]["total"] == [0, 0, 0, 0] and sent(conn)[-2]["stats"]["jobs_last_minute"] == 7
    # And a count 30 s old is made again (a change written without triggers, as a restore writes).
    settle(conn)
    conn.execute("update public.map_feed set computed_at = now() - interval '31 seconds'")
    counted = computed_at(conn)
    assert not send(conn) and computed_at(conn) > counted


def test_the_cached_summary_is_the_last_one_sent_while_the_feed_runs(
    conn: psycopg.Connection, fleet: dict[str, uuid.UUID]
) -> None:
    assert send(conn)
    assert summary(conn, cached=True)["seq"] == 1
    # A change not sent yet: the cached answer stays the one viewers hold, so the next diff applies.
    conn.execute("update public.nodes set status = 'offline' where id = %s", (fleet["tokyo"],))
    assert summary(conn, cached=True)["total"] == [3, 1, 1, 1]
    # Nobody has compared it with the fleet for 3 s (no viewer): computed now, with no seq.
    conn.execute("update public.map_feed set checked_at = now() - interval '4 seconds'")
    fresh = summary(conn, cached=True)
    assert fresh["total"] == [3, 1, 0, 2] and "seq" not in fresh


def test_anon_reads_the_map_and_cannot_send_its_summary(
    conn: psycopg.Connection, fleet: dict[str, uuid.UUID]
) -> None:
    assert send(conn)
    with as_anon(conn):
        assert value(conn, "select public.map_summary()")["seq"] == 1
        assert value(conn, "select seq from public.map_feed") == 1
        view = value(conn, "select public.map_view(-180, -90, 180, 90)")
        listed = value(conn, "select public.node_list()")
        for row in [*view["nodes"], *listed["nodes"]]:
            assert not {"endpoint_url", "owner_id", "secret_hash"} & set(row), row
        for statement in (
            "select private.send_map_summary()",
            "update public.map_feed set seq = 99",
            "select private.json_changes('{}', '{}')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege), conn.transaction():
                conn.execute(statement)


# A viewer's box -----------------------------------------------------------------------------------------


def test_a_box_with_few_nodes_gives_their_rows_and_with_many_their_clusters(
    conn: psycopg.Connection, fleet: dict[str, uuid.UUID]
) -> None:
    netherlands = value(conn, "select public.map_view(3, 50, 7, 54, 1, 300)")
    assert netherlands["count"] == 3
    assert [n["name"] for n in netherlands["nodes"]] == ["ams-1", "ams-2", "ams-3"]
    assert netherlands["nodes"][0]["warm_models"] == [LLAMA8] and netherlands["nodes"][1]["status"] == "busy"
    world = value(conn, "select public.map_view(-180, -90, 180, 90, 10, 4)")
    assert world["count"] == 5 and "nodes" not in world and world["cell_deg"] == 10
    # Cells of 10 degrees: Amsterdam's three together, Tokyo's two together.
    assert sorted(world["clusters"], key=lambda c: c[0]) == [
        [TOKYO[0], TOKYO[1], 1, 0, 1, 0],
        [pytest.approx(52.12, abs=0.01), pytest.approx(4.83, abs=0.01), 1, 1, 0, 1],
    ]
    # Corners in either order; no box at all is refused.
    assert value(conn, "select public.map_view(7, 54, 3, 50)")["count"] == 3
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("select public.map_view(null, 50, 7, 54)")


def test_a_box_never_asks_for_more_than_some_2500_cells_or_1000_rows(conn: psycopg.Connection) -> None:
    conn.execute(
        "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude, longitude)"
        " select 'n' || g, 'L4', 24, 100, 0.3, 'r', (g % 170) - 85, (g * 7 % 360) - 180"
        " from generate_series(1, 3000) g"
    )
    fine = value(conn, "select public.map_view(-180, -90, 180, 90, 0.001, 100000)")
    assert fine["count"] == 3000 and "nodes" not in fine  # 1,000 rows at most
    assert fine["cell_deg"] == pytest.approx((180 * 360 / 2500) ** 0.5)
    assert len(fine["clusters"]) <= 2500


# The table ----------------------------------------------------------------------------------------------


def names(conn: psycopg.Connection, *args: Any) -> list[str]:
    listed = value(conn, "select public.node_list(%s, %s, %s, %s, %s)", args)
    return [n["name"] for n in listed["nodes"]]


def test_the_table_pages_searches_and_sorts_in_the_database(
    conn: psycopg.Connection, fleet: dict[str, uuid.UUID]
) -> None:
    conn.execute("update public.nodes set inflight = 4 where id = %s", (fleet["ams-1"],))  # full: busy
    page = value(conn, "select public.node_list('', 'name', false, 0, 2)")
    assert (page["total"], page["offset"], page["limit"]) == (6, 0, 2)
    assert [n["name"] for n in page["nodes"]] == ["ams-1", "ams-2"]
    assert names(conn, "", "name", False, 2, 2) == ["ams-3", "h100"]
    assert names(conn, "", "name", True, 0, 3) == ["tokyo", "nowhere", "h100"]
    assert names(conn, "", "price", False, 0, 6)[:2] == ["ams-3", "ams-2"]
    assert names(conn, "", "price", True, 0, 1) == ["h100"]
    # Status by its rank, an online node with every slot taken counting as busy; ties by name.
    assert names(conn, "", "status", False, 0, 6) == ["h100", "nowhere", "ams-1", "ams-2", "tokyo", "ams-3"]
    assert names(conn, "", "load", True, 0, 1) == ["ams-1"]
    assert names(conn, "", "vram", True, 0, 1) == ["h100"]
    assert names(conn, "", "region", False, 0, 6)[:2] == ["h100", "tokyo"]  # ap-northeast first
    # Search: name, GPU model or region, in any case; or a status; % and _ are plain characters.
    assert names(conn, "AMS", "name", False, 0, 50) == ["ams-1", "ams-2", "ams-3"]
    assert names(conn, "h100", "name", False, 0, 50) == ["h100"]
    assert names(conn, "northeast", "name", False, 0, 50) == ["h100", "tokyo"]
    assert names(conn, "draining", "name", False, 0, 50) == ["tokyo"]
    assert names(conn, "%", "name", False, 0, 50) == []
    assert value(conn, "select public.node_list('zzz')") == {
        "total": 0,
        "offset": 0,
        "limit": 50,
        "nodes": [],
    }
    assert value(conn, "select public.node_list('', 'name', false, 0, 5000)")["limit"] == 1000
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("select public.node_list('', 'secret_hash')")


def test_the_tables_first_page_is_read_from_an_index_not_sorted(conn: psycopg.Connection) -> None:
    """bench map at 100,000 nodes: the map was drawn some 320 ms later than at 1,000, most of it
    node_list() sorting the fleet by name (80 ms) to keep its first 50. An unsearched page by name is
    read in order from nodes_name_idx; a search still sorts what it finds."""

    def scans() -> int:
        conn.execute("select pg_stat_clear_snapshot()")
        row = conn.execute(
            "select idx_scan from pg_stat_user_indexes where indexrelname = 'nodes_name_idx'"
        ).fetchone()
        assert row is not None, "no index nodes_name_idx"
        return int(row[0])

    for name in ("b", "A", "c"):
        make_node(conn, name)
    before = scans()
    for descending in (False, True):
        assert names(conn, "", "name", descending, 0, 2) == (["c", "b"] if descending else ["A", "b"])
        conn.execute("select pg_stat_force_next_flush()")
    assert scans() == before + 2


def test_the_table_sorts_by_the_beats_the_batches_write(
    conn: psycopg.Connection, fleet: dict[str, uuid.UUID]
) -> None:
    """A beat that changes nothing is written to node_liveness, not nodes (the heartbeats' batches):
    sorted by last heartbeat, a node beating that way is the freshest, as node_map shows it."""
    conn.execute("update public.nodes set last_heartbeat_at = now() - interval '1 hour'")
    conn.execute(
        "update public.nodes set last_heartbeat_at = now() - interval '1 minute' where name = 'tokyo'"
    )
    conn.execute(
        "insert into public.node_liveness (node_id, last_heartbeat_at) values (%s, now())", (fleet["h100"],)
    )
    assert names(conn, "", "beat", True, 0, 2) == ["h100", "tokyo"]
