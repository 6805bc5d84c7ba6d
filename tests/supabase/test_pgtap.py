"""The pgTAP tests of supabase/tests/database, run by pg_prove as `supabase test db` runs them, against a
freshly migrated Supabase-shaped database (tests/supabase/conftest.py: migrated as the non-superuser
postgres, with supautils' policy grant as hosted). How pgTAP reaches the embedded PostgreSQL 18:
tests/supabase/pgtap.py.

Debian's `pgtap` (pg_prove) and `postgresql-15-pgtap` (pgTAP's SQL); `./dev test` installs them, and
these tests are skipped where they are missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from tests.supabase import pgtap
from tests.supabase.shaped import ShapedCluster


@pytest.fixture(scope="session")
def pgtap_dir() -> Iterator[Path]:
    if pgtap.pg_prove() is None:
        pytest.skip("pg_prove is not installed (./dev test installs Debian's pgtap package)")
    control = pgtap.pgtap_control()
    if control is None:
        pytest.skip("pgTAP's SQL is not installed (./dev test installs Debian's postgresql-15-pgtap)")
    with pgtap.extension_dir(control) as directory:
        yield directory


@pytest.fixture
def database(shaped: ShapedCluster, conn: psycopg.Connection, pgtap_dir: Path) -> str:
    """A fresh hosted-shaped test database on which CREATE EXTENSION pgtap works."""
    name = conn.info.dbname
    pgtap.offer_pgtap(shaped.server, name, pgtap_dir)
    return name


def test_the_pgtap_tests_pass(
    shaped: ShapedCluster,
    database: str,
    record_property: Callable[[str, object], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = pgtap.pgtap_files()
    assert files, f"no pgTAP tests in {pgtap.TESTS_DIR}"
    proved = pgtap.prove(shaped.server, database, files)
    record_property("pgtap_tests", proved.tests)
    with capsys.disabled():
        print(f"\npgTAP: {proved.tests} tests in {len(files)} files (supabase/tests/database)", end=" ")
    assert proved.passed, f"pg_prove failed:\n{proved.output}"
    # Every file ran to its end: pg_prove counts what ran, each file plans what it should.
    assert proved.tests == pgtap.planned(files), proved.output


def test_a_broken_grant_fails_them(shaped: ShapedCluster, database: str) -> None:
    """The tests can fail: with anon allowed to read where nodes are reached, the structure and nodes
    files fail, on the very checks that say so."""
    with psycopg.connect(shaped.server.url(database), autocommit=True) as admin:
        admin.execute("grant select (endpoint_url) on public.nodes to anon")
    files = [f for f in pgtap.pgtap_files() if f.stem.endswith(("_test_helpers", "_structure", "_nodes"))]
    assert len(files) == 3
    proved = pgtap.prove(shaped.server, database, files)
    assert not proved.passed, proved.output
    assert "anon reads every column of nodes but its owner, endpoint" in proved.output
    assert "anon cannot read where a node is reached (endpoint_url)" in proved.output
