"""What an operator sees at an 80-column terminal: the version, help, `nodes ls` (verification too),
`keys ls`, `models pin`, bad settings."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner, Result

from neuralgrid.cli import app
from neuralgrid.cli.fleet import heartbeat_age
from neuralgrid.dev.demo import DEMO_FLEET
from tests.db.test_verification_on_the_map import challenged, fail_model, pin_model

CUT = "…"  # what rich prints where it cuts a cell


def invoke(*args: str, columns: int = 80, **env: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns), **env})


def test_version_prints_the_package_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"neuralgrid {importlib.metadata.version('neuralgrid')}"


def test_node_run_help_shows_every_env_var_whole_at_80_columns() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    node_group = group.commands["node"]
    assert isinstance(node_group, TyperGroup)
    names = [p.envvar for p in node_group.commands["run"].params if isinstance(p.envvar, str)]
    assert len(names) > 10

    result = invoke("node", "run", "--help")
    assert result.exit_code == 0
    for name in names:
        assert re.search(rf"\b{name}\b", result.stdout), name


# A terminal of 80 columns, and a pipe (no COLUMNS: Rich would assume 80 and cut).
WIDTHS: tuple[dict[str, str | None], ...] = ({"COLUMNS": "80"}, {"COLUMNS": None})


def invoke_at(width: dict[str, str | None], *args: str, **env: str) -> Result:
    return CliRunner().invoke(app, list(args), env={**width, **env})


def widest(result: Result) -> int:
    return max(len(line) for line in result.stdout.splitlines())


def row_of(result: Result, name: str) -> str:
    return next(line for line in result.stdout.splitlines() if line.startswith(f"{name} "))


def test_nodes_ls_fits_80_columns_with_reputation_and_heartbeat_ages(
    conn: psycopg.Connection, db_url: str
) -> None:
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    conn.execute("update nodes set last_heartbeat_at = now() - interval '12 seconds'")
    conn.execute("update nodes set successes = 990, failures = 10 where name = 'tokyo-rtx4090'")
    names = [row[0] for row in conn.execute("select name from nodes")]

    for width in WIDTHS:
        narrow = invoke_at(width, "nodes", "ls", DATABASE_URL=db_url)
        assert narrow.exit_code == 0, narrow.output
        assert CUT not in narrow.stdout and widest(narrow) <= 80, (width, narrow.stdout)
        assert len(narrow.stdout.splitlines()) == 2 + len(names)  # a line a node: nothing wrapped
        header = narrow.stdout.splitlines()[0].split()
        assert {"name", "gpu", "status", "load", "heartbeat", "reputation"} <= set(header)
        tokyo = row_of(narrow, "tokyo-rtx4090")
        assert "RTX 4090" in tokyo and "online" in tokyo and "0/12" in tokyo and "99.0%" in tokyo
        assert re.search(r"\b1[2-4] s ago\b", tokyo), tokyo  # an age, never a clock time without a zone
        assert not re.search(r"\d\d:\d\d:\d\d", narrow.stdout)
        assert "no jobs" in row_of(narrow, "london-l4")
        assert all(re.search(rf"^{name} ", narrow.stdout, re.M) for name in names)


def node_ids(conn: psycopg.Connection) -> dict[str, uuid.UUID]:
    return {str(name): uuid.UUID(str(node)) for name, node in conn.execute("select name, id from nodes")}


QWEN14 = "Qwen/Qwen2.5-14B-Instruct"  # 9 of the demo's 24 nodes hold it


def test_nodes_ls_says_which_nodes_failed_verification(conn: psycopg.Connection, db_url: str) -> None:
    """Narrow, under the table (it has no room for a column at 80); --wide, a column for every node."""
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    ids = node_ids(conn)
    pin_model(conn, QWEN14)
    fail_model(conn, ids["ashburn-h100"], QWEN14)
    fail_model(conn, ids["seattle-a100-80g"], QWEN14)
    challenged(conn, ids["warsaw-a100-80g"], QWEN14, False)
    for width in WIDTHS:
        narrow = invoke_at(width, "nodes", "ls", DATABASE_URL=db_url)
        assert narrow.exit_code == 0, narrow.output
        assert CUT not in narrow.stdout and widest(narrow) <= 80, (width, narrow.stdout)
        lines = narrow.stdout.splitlines()
        assert all(re.search(rf"^{name} ", narrow.stdout, re.M) for name in ids)  # a line a node
        under = " ".join(line.strip() for line in lines[2 + len(ids) :])  # then the flags, wrapped at 80
        assert under == (
            "failed verification: ashburn-h100, seattle-a100-80g (no requests for the failed model)"
            " suspect verification: warsaw-a100-80g (challenged more often)"
        )
    wide = invoke_at(WIDTHS[1], "nodes", "ls", "--wide", DATABASE_URL=db_url)
    assert "verification" in wide.stdout.splitlines()[0].split()
    expected = {
        "ashburn-h100": "failed",
        "warsaw-a100-80g": "suspect",
        "london-a100-40g": "unverified",
        "newyork-rtx3090": "-",  # holds no pinned model
    }
    for name, state in expected.items():
        assert state in row_of(wide, name).split(), (name, row_of(wide, name))
    listed = {
        n["name"]: n["verification"]
        for n in json.loads(invoke("nodes", "ls", "--json", DATABASE_URL=db_url).stdout)
    }
    assert (listed["ashburn-h100"], listed["newyork-rtx3090"]) == ("failed", None)


def test_nodes_ls_names_the_nodes_whose_gpu_failed_its_probe(conn: psycopg.Connection, db_url: str) -> None:
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    ids = node_ids(conn)
    for name in ("ashburn-h100", "warsaw-a100-80g"):  # run by agents: their GPUs are probed
        conn.execute("update nodes set secret_hash = %s where id = %s", (os.urandom(32), ids[name]))
    conn.execute("select record_gpu_probe(%s, 'wrong')", (ids["ashburn-h100"],))
    conn.execute("select record_gpu_probe(%s, 'passed')", (ids["warsaw-a100-80g"],))
    for width in WIDTHS:
        narrow = invoke_at(width, "nodes", "ls", DATABASE_URL=db_url)
        assert narrow.exit_code == 0 and widest(narrow) <= 80, narrow.stdout
        assert narrow.stdout.splitlines()[-1] == "GPU failed its probe: ashburn-h100 (no requests)"
    wide = invoke_at(WIDTHS[1], "nodes", "ls", "--wide", DATABASE_URL=db_url)
    assert "proof" in wide.stdout.splitlines()[0].split()
    expected = {"ashburn-h100": "failed", "warsaw-a100-80g": "proven", "newyork-rtx3090": "-"}
    for name, state in expected.items():
        assert state in row_of(wide, name).split(), (name, row_of(wide, name))


def test_heartbeats_read_as_ages() -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    ages = {0: "0 s ago", 12: "12 s ago", 59: "59 s ago", 60: "1 min ago", 3599: "59 min ago"}
    ages |= {3600: "1 h ago", 47 * 3600: "47 h ago", 48 * 3600: "2 d ago", -3: "0 s ago"}
    for seconds, age in ages.items():
        assert heartbeat_age(now - timedelta(seconds=seconds), now) == age
    assert heartbeat_age(None, now) == "never"


def test_nodes_ls_wide_drops_and_cuts_nothing_at_80_columns(conn: psycopg.Connection, db_url: str) -> None:
    """--wide is wider than 80 columns: on a terminal its long cells wrap, piped a node is a line;
    either way no column is dropped and no cell cut."""
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    for width in WIDTHS:
        wide = invoke_at(width, "nodes", "ls", "--wide", DATABASE_URL=db_url)
        assert wide.exit_code == 0, wide.output
        assert CUT not in wide.stdout
        header = wide.stdout.splitlines()[0]
        for column in (
            "gpu",
            "vram",
            "tflops",
            "$/h",
            "region",
            "status",
            "heartbeat",
            "ok/fail",
            "reputation",
        ):
            assert column in header.split(), (width, header)
        assert "warm models" in header
        frankfurt = row_of(wide, "frankfurt-rtx4090")
        for cell in ("NVIDIA GeForce RTX 4090", "eu-central", "online", "0/12", "0/0"):
            assert cell in frankfurt, (width, frankfurt)
        for model in (
            "BAAI/bge-large-en-v1.5",
            "Qwen/Qwen2.5-32B-Instruct-AWQ",
            "meta-llama/Llama-3.1-8B-Instruct",
        ):
            assert model in wide.stdout
    piped = invoke_at(WIDTHS[1], "nodes", "ls", "--wide", DATABASE_URL=db_url)
    assert "meta-llama/Llama-3.1-8B-Instruct" in row_of(piped, "frankfurt-rtx4090")  # grep finds a node whole


def test_keys_ls_fits_80_columns_and_wide_shows_every_column(conn: psycopg.Connection, db_url: str) -> None:
    create = "select api_key from create_api_key(%s, %s, %s, %s)"
    conn.execute(create, ("a laptop of mine", 600, 100_000, 5))
    conn.execute(create, ("ci", None, None, None))
    conn.execute(
        "update api_keys set last_used_at = now(), spent_usd = 0.012345 where name = 'a laptop of mine'"
    )
    conn.execute("update api_keys set revoked_at = now() where name = 'ci'")
    prefixes = [row[0] for row in conn.execute("select prefix from api_keys order by created_at")]

    narrow = invoke("keys", "ls", DATABASE_URL=db_url)
    assert narrow.exit_code == 0, narrow.output
    assert CUT not in narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
    laptop = next(line for line in narrow.stdout.splitlines() if prefixes[0] in line)
    for cell in ("600/100000", "0.012345/5.00", "active"):
        assert cell in laptop
    ci = next(line for line in narrow.stdout.splitlines() if prefixes[1] in line)
    assert "-/-" in ci and "never" in ci and "revoked" in ci

    wide = invoke("keys", "ls", "--wide", DATABASE_URL=db_url, columns=200)
    assert wide.exit_code == 0 and CUT not in wide.stdout
    ids = [str(row[0]) for row in conn.execute("select id from api_keys")]
    assert all(key_id in wide.stdout for key_id in ids)


def test_a_malformed_database_url_is_one_line_naming_it() -> None:
    result = invoke("nodes", "ls", DATABASE_URL="not-a-url")
    assert result.exit_code == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "DATABASE_URL" in line and "postgresql://" in line
    assert "not-a-url" not in line  # a URL is never echoed: it may carry a password


def test_match_fits_80_columns_and_wide_shows_every_component(db_url: str) -> None:
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    model = "meta-llama/Llama-3.1-8B-Instruct"

    for width in WIDTHS:
        ranked = invoke_at(width, "match", "--model", model, DATABASE_URL=db_url)
        assert ranked.exit_code == 0, ranked.output
        assert widest(ranked) <= 80 and CUT not in ranked.stdout, (width, ranked.stdout)
        for cell in ("score", "fit", "warm", "price", "reserve", "tokyo-rtx4090"):
            assert cell in ranked.stdout
        assert "proximity" not in ranked.stdout

    wide = invoke("match", "--model", model, "--wide", DATABASE_URL=db_url, columns=200)
    assert wide.exit_code == 0 and CUT not in wide.stdout
    for cell in ("capacity", "reputation", "proximity"):
        assert cell in wide.stdout

    no_rerank = invoke("match", "--model", model, "--route", "rerank", DATABASE_URL=db_url)
    assert no_rerank.exit_code == 0 and "tokyo-rtx4090" not in no_rerank.stdout
    bad = invoke("match", "--model", model, "--route", "teleport", DATABASE_URL=db_url)
    assert bad.exit_code == 1 and "--route" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_match_explain_fits_80_columns_with_the_reasons_grouped(db_url: str) -> None:
    """The ranking, then why the others lost: a line a reason, with how many nodes it rejects."""
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    big = "meta-llama/Llama-3.3-70B-Instruct-AWQ"  # 42 GB: 15 cards of 24 GB, 2 of 40 GB
    for width in WIDTHS:
        explained = invoke_at(width, "match", "--model", big, "--explain", DATABASE_URL=db_url)
        assert explained.exit_code == 0, explained.output
        assert widest(explained) <= 80 and CUT not in explained.stdout, (width, explained.stdout)
        lines = explained.stdout.splitlines()
        assert "warsaw-rtx3090x2" in explained.stdout  # the ranking comes first
        assert "17 nodes rejected:" in lines
        [small] = [line for line in lines if "24 GB VRAM, needs 42 GB" in line]
        assert small.strip().startswith("15 nodes: 24 GB VRAM, needs 42 GB")
        [forty] = [line for line in lines if "40 GB VRAM, needs 42 GB" in line]
        assert forty.strip().startswith("2 nodes: 40 GB VRAM, needs 42 GB")
        assert "seoul-a100-40g" in explained.stdout and "london-a100-40g" in explained.stdout

        unheld = invoke_at(
            width, "match", "--model", "my/model", "--min-vram", "1", "--explain", DATABASE_URL=db_url
        )
        assert unheld.exit_code == 0, unheld.output
        assert widest(unheld) <= 80 and CUT not in unheld.stdout
        [reason] = [line for line in unheld.stdout.splitlines() if "hold" in line]
        assert reason.strip().startswith("24 nodes do not hold my/model"), unheld.stdout


# Pinning a model to its file ------------------------------------------------------------------------


def gguf(tmp_path: Path, content: bytes = b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 9000) -> Path:
    """A file that starts as a GGUF does, bigger than one read of the hash (2.3 MB)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return path


def artifact(conn: psycopg.Connection, model: str) -> tuple[str, str] | None:
    row = conn.execute("select format, sha256 from model_artifacts where model_id = %s", (model,)).fetchone()
    return None if row is None else (str(row[0]), str(row[1]))


def test_models_pin_hashes_the_gguf_and_puts_its_nodes_under_verification(
    conn: psycopg.Connection, db_url: str, tmp_path: Path
) -> None:
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    holders = conn.execute("select count(*) from node_models where model_id = %s", (QWEN14,)).fetchone()
    assert holders is not None and holders[0] > 1
    path = gguf(tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    result = invoke("models", "pin", QWEN14, "--gguf", str(path), DATABASE_URL=db_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"pinned {QWEN14} to the GGUF file with sha256 {digest}",
        f"{holders[0]} nodes hold it: each is under verification",
    ]
    assert artifact(conn, QWEN14) == ("gguf", digest)
    states = conn.execute("select distinct state from model_checks where model_id = %s", (QWEN14,)).fetchall()
    assert states == [("unverified",)]

    # Pinned again, by a sha256 given as text (any case): the new file replaces the old.
    again = invoke("models", "pin", QWEN14, "--sha256", "AB" * 32, DATABASE_URL=db_url)
    assert again.exit_code == 0, again.output
    assert artifact(conn, QWEN14) == ("gguf", "ab" * 32)


def test_models_pin_refuses_bad_input_in_one_line(
    conn: psycopg.Connection, db_url: str, tmp_path: Path
) -> None:
    path = gguf(tmp_path)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a model")

    def refused(*args: str) -> str:
        result = invoke("models", "pin", *args, DATABASE_URL=db_url)
        assert result.exit_code == 1 and result.stdout == "", result.output
        [line] = result.stderr.splitlines()
        assert line.startswith("error: ")
        return line

    assert "one of the two" in refused(QWEN14)
    assert "one of the two" in refused(QWEN14, "--gguf", str(path), "--sha256", "a" * 64)
    assert "64 hex digits" in refused(QWEN14, "--sha256", "a" * 63)
    assert "64 hex digits" in refused(QWEN14, "--sha256", "g" * 64)
    assert "is not a GGUF file" in refused(QWEN14, "--gguf", str(not_gguf))
    assert "cannot read" in refused(QWEN14, "--gguf", str(tmp_path / "missing.gguf"))
    assert "is a directory" in refused(QWEN14, "--gguf", str(tmp_path))
    line = refused("no/such-model", "--gguf", str(path))
    assert "'no/such-model' is not a catalog model" in line and QWEN14 in line
    assert artifact(conn, QWEN14) is None and artifact(conn, "no/such-model") is None
