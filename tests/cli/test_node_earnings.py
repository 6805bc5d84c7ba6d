"""`neuralgrid node earnings` against a real gateway: an owner's earnings per node and model over a
period, at 80 columns; one line and a non-zero exit when there is nothing to show or no access."""

from __future__ import annotations

import re

import psycopg
from typer.testing import CliRunner, Result

from neuralgrid.cli import app
from tests.conftest import LLAMA8, free_port, make_user
from tests.web.test_owner_page import QWEN, owner_api_key, owner_world


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
