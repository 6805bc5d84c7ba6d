"""`neuralgrid node earnings` against a real gateway: an owner's earnings per node and model over a
period, what is held and forfeited, and each model's verification, at 80 columns; `neuralgrid node
verify` asking again for a failed one; one line and a non-zero exit when there is nothing to show or
no access."""

from __future__ import annotations

import re

import psycopg
from typer.testing import CliRunner, Result

from neuralgrid.cli import app
from tests.conftest import LLAMA8, free_port, make_user
from tests.db.test_verification_on_the_map import REASON, fail_model, pin_model, verification
from tests.web.test_owner_page import QWEN, failed_world, held, owner_api_key, owner_world


def earnings(gateway: str, token: str, *args: str) -> Result:
    env = {"COLUMNS": "80", "NEURALGRID_GATEWAY_URL": gateway, "NEURALGRID_NODE_TOKEN": token}
    return CliRunner().invoke(app, ["node", "earnings", *args], env=env)


ROW = re.compile(r"^(\S.*?|  \S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


def table(result: Result) -> list[tuple[str, list[str]]]:
    """The table's rows: the node or (indented) model, then jobs, charged, fee and earned."""
    found = [ROW.match(line) for line in result.stdout.splitlines()]
    return [(m[1], list(m.groups()[1:])) for m in found if m]


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ")
    return line


def test_an_owner_sees_earnings_per_node_and_model_at_80_columns(
    conn: psycopg.Connection, gateway: str
) -> None:
    owner = make_user(conn)
    owner_world(conn, owner)
    key = owner_api_key(conn, owner)
    result = earnings(gateway, key)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.stdout
    assert lines[0].startswith("Earnings of your nodes over the last 30 days (UTC), from ")
    assert table(result) == [
        ("my-4090", ["2", "3.00", "0.45", "2.55"]),
        (f"  {QWEN}", ["1", "2.00", "0.30", "1.70"]),
        (f"  {LLAMA8}", ["1", "1.00", "0.15", "0.85"]),
        ("my-a100", ["2", "1.40", "0.21", "1.19"]),
        (f"  {LLAMA8}", ["2", "1.40", "0.21", "1.19"]),
        ("total", ["4", "4.40", "0.66", "3.74"]),
    ]
    assert "someone-elses" not in result.stdout
    assert re.search(r"platform fee: 15% of what developers were charged", result.stdout)

    week = earnings(gateway, key, "--days", "7")
    assert week.exit_code == 0, week.output
    assert table(week)[-1] == ("total", ["3", "3.40", "0.51", "2.89"])


def test_nothing_to_show_or_no_access_is_one_line_and_a_nonzero_exit(
    conn: psycopg.Connection, gateway: str
) -> None:
    nobody = make_user(conn)
    assert "you have no nodes" in one_line_error(earnings(gateway, owner_api_key(conn, nobody)))

    owner = make_user(conn)
    owner_world(conn, owner)
    conn.execute(
        "delete from earnings where owner_id = %s and earned_at > now() - interval '2 days'", (owner,)
    )
    key = owner_api_key(conn, owner)
    line = one_line_error(earnings(gateway, key, "--days", "2"))
    assert "no earnings in the last 2 days" in line and "2 nodes" in line

    operator = conn.execute("select api_key from create_api_key('operator')").fetchone()
    assert operator is not None
    assert "belongs to no user" in one_line_error(earnings(gateway, str(operator[0])))
    assert "unknown API key" in one_line_error(earnings(gateway, "ng-0000"))
    assert "cannot reach the gateway" in one_line_error(earnings(f"http://127.0.0.1:{free_port()}", key))
    for days in ("0", "3661"):
        assert "--days" in one_line_error(earnings(gateway, key, "--days", days))


def verify(gateway: str, token: str, *args: str) -> Result:
    env = {"COLUMNS": "80", "NEURALGRID_GATEWAY_URL": gateway, "NEURALGRID_NODE_TOKEN": token}
    return CliRunner().invoke(app, ["node", "verify", *args], env=env)


CHECK = re.compile(r"^  (\S+)\s+(failed|suspect|unverified|verified)\s+(\d+)\s+(\d+)\s+(.+ ago)$")


def test_earnings_say_what_is_held_forfeited_and_how_each_model_fares_under_verification(
    conn: psycopg.Connection, gateway: str
) -> None:
    owner = make_user(conn)
    failed_world(conn, owner)
    result = earnings(gateway, owner_api_key(conn, owner))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in result.stdout
    assert table(result)[-1] == ("total", ["5", "4.60", "0.69", "3.91"])  # the forfeited job left out
    assert "\nheld: $0.17 not settled yet: forfeited if its model fails verification\n" in result.stdout
    assert "\nforfeited: $0.51 by models that failed verification (not in the total)\n" in result.stdout

    start = lines.index("Verification of your nodes' models (the platform's challenges)")
    checks = [line.rstrip() for line in lines[start:]]
    assert [(m[1], m[2], m[3], m[4]) for m in map(CHECK.match, checks) if m] == [
        (LLAMA8, "failed", "0", "2"),
        (LLAMA8, "unverified", "0", "0"),
    ]
    # Under the failed model, its last failure's reason, indented as a whole where it wraps.
    first = next(i for i, line in enumerate(checks) if line.startswith(f"  {LLAMA8}"))
    below = checks[first + 1 : checks.index("my-a100")]
    assert all(line.startswith("    ") for line in below)
    assert " ".join(line.strip() for line in below) == f"last failure: {REASON}"
    assert "`neuralgrid node verify NODE`" in result.stdout


def test_all_earnings_forfeited_still_shows_why(conn: psycopg.Connection, gateway: str) -> None:
    owner = make_user(conn)
    world = owner_world(conn, owner)
    conn.execute("delete from earnings where owner_id = %s", (owner,))
    held(conn, world["mine"], owner, LLAMA8, "1.00")  # the only earning, forfeited by the failure
    pin_model(conn)
    fail_model(conn, world["mine"])
    result = earnings(gateway, owner_api_key(conn, owner))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("No earnings in the last 30 days (forfeited ones aside)\n")
    assert "\nforfeited: $0.85 by models that failed verification (not in the total)\n" in result.stdout
    assert any(m and m[2] == "failed" for m in map(CHECK.match, result.stdout.splitlines()))


def test_node_verify_starts_a_failed_model_over_and_refuses_in_one_line(
    conn: psycopg.Connection, gateway: str
) -> None:
    owner = make_user(conn)
    world = failed_world(conn, owner)
    key = owner_api_key(conn, owner)
    result = verify(gateway, key, "my-4090")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"my-4090: {LLAMA8} starts over, unverified",
        "it gets requests again, and is challenged at once",
    ]
    assert verification(conn, world["mine"]) == "unverified"

    assert "none of my-4090's models can start over now" in one_line_error(verify(gateway, key, "my-4090"))
    assert "none of my-a100's models can start over" in one_line_error(verify(gateway, key, "my-a100"))
    line = one_line_error(verify(gateway, key, "someone-elses"))
    assert "(404)" in line and "you have no node named 'someone-elses'" in line
    fail_model(conn, world["mine"])
    assert verify(gateway, key, str(world["mine"])).exit_code == 0  # by id
    assert "unknown API key" in one_line_error(verify(gateway, "ng-0000", "my-4090"))
    assert "cannot reach the gateway" in one_line_error(verify(f"http://127.0.0.1:{free_port()}", key, "x"))
    alone = CliRunner().invoke(
        app, ["node", "verify", "my-4090", "--gateway", gateway], env={"COLUMNS": "80"}
    )
    assert "--gateway and --token go together" in one_line_error(alone)
