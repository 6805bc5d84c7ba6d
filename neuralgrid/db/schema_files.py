"""`supabase/schemas/`: what the migrations build, today, as one file per domain.

The migrations are the history and how a change ships (new files only, each `create or replace`
whole); the schema files are the present, where a reviewer reads an object whole. This module writes
them from a database built from the migrations: `pg_dump --schema-only` of `public` and `private`,
each object followed by its comments, grants, constraints, indexes, triggers and policies, and placed
in its domain's file by DOMAINS below. What pg_dump leaves out of those two schemas is written from
the catalog: the roles of our own, the policies on `realtime.messages`, the tables in the Realtime
publication and the event trigger. The catalog's rows (models, policies, settings) close the set.

`python -m neuralgrid.db.schema_files write` rewrites the files; `tests/db/test_schema_files.py`
builds one database from the migrations and one from these files and compares their dumps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psycopg

from neuralgrid.db.embedded import POSTGRES_BIN_PATH

SCHEMAS_DIR = Path(__file__).resolve().parents[2] / "supabase" / "schemas"
DUMPED_SCHEMAS = ("public", "private")
# Reference rows the platform cannot run without: part of what the schema is today.
CATALOG_TABLES = (
    "public.models",
    "public.model_artifacts",
    "public.matching_policies",
    "public.platform_settings",
)

# Each object the migrations create, by the file that holds it. A table's or view's comments, grants,
# constraints, indexes and policies go with it, a trigger with its function; all overloads of a
# function go together.
# The files apply in order, so an object comes after what its definition names (a trigger's function
# before its table's file, or in it).
# The first line of each is the file's title.
DOMAINS: dict[str, tuple[str, ...]] = {
    "010_foundation": (
        "The private schema, our own roles, and the small helpers every domain uses.",
        "schema private",
        "schema public",
        "roles",
        "private.set_updated_at",
        "private.great_circle_km",
        "private.parse_ipv4",
        "private.address_is_public",
        "private.endpoint_is_private",
        "private.ewma_fold",
        "private.cooldown_until",
    ),
    "020_catalog": (
        "The catalog: models, matching policies and the platform's settings.",
        "public.models",
        "public.matching_policies",
        "public.platform_settings",
        "private.required_vram_gb",
        "private.vram_tier",
    ),
    "030_nodes": (
        "Nodes: what owners register, the models they hold, their endpoints and status history.",
        "public.nodes",
        "public.node_models",
        "public.node_endpoints",
        "public.node_status_changes",
        "private.nodes_check_description",
        "private.nodes_derive_outside_load",
        "private.nodes_derive_routes",
        "private.nodes_keep_price_floor",
        "private.check_owner_endpoint",
        "private.copy_node_endpoint",
        "private.record_node_status",
        "private.announce_free_slot",
        "private.notify_node_secret_change",
        "public.register_node",
    ),
    "050_api_keys": (
        "API keys: issued by create_api_key(), checked, revoked for good.",
        "public.api_keys",
        "private.api_keys_check_description",
        "private.api_keys_issued_only",
        "private.api_keys_revocation_is_final",
        "private.notify_api_key_change",
        "public.create_api_key",
        "public.revoke_api_key",
    ),
    "060_jobs": (
        "Jobs: placement, claims, failover, completion and each job's attempts.",
        "public.jobs",
        "public.job_attempts",
        "private.stamp_job_gateway",
        "private.mark_cold_start",
        "private.budget_hold",
        "private.answer_cap",
        "private.release_reservation",
        "private.claim_node",
        "private.release_node",
        "private.end_attempt",
        "private.move_job",
        "private.abandon_job",
        "private.place",
        "public.place_job",
        "public.place_jobs",
        "private.end_jobs",
        "public.complete_job",
        "public.complete_jobs",
        "public.failover_job",
        "public.handoff_job",
        "public.reject_job",
        "public.continuing_nodes",
    ),
    "070_earnings": (
        "Earnings: the owners' ledger, written as paid jobs end.",
        "public.earnings",
        "private.write_earnings",
        "private.record_earning",
        "public.my_earnings",
        "public.my_earnings_totals",
        "public.my_node_stats",
    ),
    "075_verification": (
        "Verification: pinned artifacts, challenges and the sequential test per (node, model); GPU probes.",
        "public.model_artifacts",
        "public.model_checks",
        "public.model_challenges",
        "private.check_new_node_model",
        "private.check_pinned_model",
        "private.check_repinned_model",
        "private.checks_back_in_the_matcher",
        "private.forfeit_unverified_on_delete",
        "private.challenge_step",
        "private.challenge_bounds",
        "private.challenge_key_id",
        "public.due_challenges",
        "public.due_cross_checks",
        "private.take_due_checks",
        "public.place_challenge",
        "public.record_challenges",
        "public.request_verification",
        "public.my_model_checks",
        "private.node_verification",
        "private.note_node_verification",
        "public.gpu_proofs",
        "public.gpu_probes",
        "public.due_gpu_probes",
        "public.record_gpu_probe",
        "private.start_gpu_proof",
    ),
    "080_matcher": (
        "The matcher: score_nodes(), the scores kept per node and model, and what ranks a node.",
        "public.node_scores",
        "public.node_base_scores",
        "private.node_components",
        "private.vram_pressure",
        "private.node_is_eligible",
        "private.reject_reason",
        "private.proximity_component",
        "private.reserve_component",
        "private.kept_level",
        "private.kept_last",
        "private.ranking_limit",
        "private.top_by_base",
        "private.top_by_total",
        "private.capacity_state",
        "private.refresh_node_scores",
        "private.refresh_vram_pressure",
        "private.node_scores_after_catalog_change",
        "private.node_scores_after_node_models_change",
        "private.node_scores_after_node_update",
        "private.node_scores_after_nodes_insert",
        "public.score_nodes",
        "public.match_job",
    ),
    "090_node_agent": (
        "Node agents: heartbeats, gateways and the tunnels they hold, pre-warming.",
        "private.gateways",
        "private.gateway_is_live",
        "public.gateway_alive",
        "private.tunnel_routes",
        "public.attach_tunnel",
        "public.detach_tunnel",
        "public.restore_tunnels",
        "public.tunnel_route",
        "public.set_tunnel",
        "private.sync_warm_models",
        "public.prewarm_requests",
        "private.prewarm_demand",
        "private.prewarm_clock",
        "private.prewarm_for",
        "private.refresh_prewarm_demand",
        "public.agent_heartbeat",
        "public.node_liveness",
        "public.node_heartbeats",
    ),
    "095_leases": (
        "Leases: slots and budgets gateways hold to dispatch without asking, and the jobs they write behind.",
        "private.slot_leases",
        "private.lane_demand",
        "private.key_escrows",
        "private.lease_usable_nodes",
        "private.lane_can_rank",
        "private.leased_slots",
        "private.move_lease_slots",
        "private.return_lent_slot",
        "private.moved_into_lease",
        "private.lane_turn",
        "private.lane_target",
        "private.renew_lane",
        "public.renew_leases",
        "public.record_jobs",
        "public.move_to_lease",
        "public.renew_escrows",
    ),
    "100_realtime": (
        "Realtime: what the map and owners hear when nodes and jobs change.",
        "private.node_map_payload",
        "private.broadcast_node_change",
        "private.broadcast_job_change",
        "public.fleet_activity",
        "private.refresh_fleet_activity",
        "realtime policies",
        "realtime publication",
    ),
    "110_data_api": (
        "The Data API: views and functions for supabase-js, under row-level security.",
        "public.node_map",
        "public.my_api_keys",
        "public.my_usage",
        "public.my_nodes",
        "public.fleet_stats",
    ),
    "115_map": (
        "The map at any size: a summary of the fleet, broadcast at most once a second, and a viewer's view.",
        "public.nodes_map_tile",
        "public.map_feed",
        "public.map_summary",
        "private.json_changes",
        "private.map_changes",
        "private.note_map_change",
        "private.send_map_summary",
        "public.map_view",
        "public.node_list",
    ),
    "120_edge_functions": (
        "What the Edge Functions call, each as a role of its own.",
        "public.node_heartbeat",
        "public.agent_heartbeat_with_secret",
    ),
    "130_sweep": (
        "The sweep: silent nodes, orphaned jobs and dead tunnels; pg_cron's schedule where it runs.",
        "private.sweep_orphaned_jobs",
        "private.sweep_dead_tunnels",
        "private.sweepable_jobs",
        "private.sweep_leases",
        "public.sweep_stale_jobs",
        "public.sweep_stale_nodes",
        "public.sweep",
        "public.schedule_sweep",
        "private.schedule_sweep_with_pg_cron",
        "event triggers",
    ),
    "900_catalog_rows": (
        "The catalog's rows (models, policies, settings) as the migrations leave them.",
        "catalog rows",
    ),
}

HEADER = re.compile(
    r"^--\n-- Name: (?P<name>.*); Type: (?P<type>.*); Schema: (?P<schema>.*); Owner: .*\n--\n", re.M
)
# Entries named "<table> <something>": the something belongs to the table.
ON_A_TABLE = {"CONSTRAINT", "FK CONSTRAINT", "TRIGGER", "POLICY", "RULE", "DEFAULT"}
ACL_TARGET = re.compile(
    r"^(?:GRANT|REVOKE) [A-Z, ()a-z_]+ ON ((?:TABLE|SEQUENCE|FUNCTION) public\.[^\n]+?) (?:TO|FROM) ", re.M
)
AFTER_WHAT_THEY_NAME = {"TRIGGER", "FK CONSTRAINT", "POLICY"}
NAMED = re.compile(r"\b(public|private)\.([a-z_]+)\b")
# Entries named "<KIND> <object>": a comment or a grant on an object of that kind.
ABOUT_AN_OBJECT = {"COMMENT", "ACL"}
# Session settings that pg_dump puts before every dump: one header per file says the same.
FILE_PREAMBLE = """\
-- {title}
-- Generated by `python -m neuralgrid.db.schema_files write` from the migrations; read here, ship a
-- change as a new migration (see CONTRIBUTING.md). tests/db/test_schema_files.py keeps the two equal.

set check_function_bodies = false;
set client_min_messages = warning;
select pg_catalog.set_config('search_path', '', false);
"""


def pg_tool(name: str) -> str:
    return str(POSTGRES_BIN_PATH / name)


def pg_env() -> dict[str, str]:
    lib = str(POSTGRES_BIN_PATH.parent / "lib")
    return {**os.environ, "LD_LIBRARY_PATH": lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}


def dump_schema(url: str, *extra: str) -> str:
    """pg_dump's schema-only text of `public` and `private`, without its random `\\restrict` key."""
    args = [pg_tool("pg_dump"), "--schema-only", *[f"--schema={s}" for s in DUMPED_SCHEMAS], *extra, url]
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=pg_env()).stdout
    return "\n".join(line for line in out.splitlines() if not line.startswith(("\\restrict", "\\unrestrict")))


@dataclass
class Entry:
    kind: str
    schema: str
    name: str
    sql: str


def entries(dump: str) -> list[Entry]:
    """The dump cut at pg_dump's `-- Name: ...; Type: ...` headers, one entry per object."""
    marks = list(HEADER.finditer(dump))
    found = []
    for mark, after in zip(marks, [*marks[1:], None], strict=True):
        body = dump[mark.end() : after.start() if after else len(dump)]
        body = body.split("\n--\n-- PostgreSQL database dump complete")[0]
        if mark["type"] == "SCHEMA":  # `public` exists in every database, `private` on a second run
            body = body.replace("CREATE SCHEMA ", "CREATE SCHEMA IF NOT EXISTS ", 1)
        if mark["type"] == "ACL" and mark["schema"] == "public" and not mark["name"].startswith("COLUMN "):
            # The default privileges of `public` (Supabase's, and the compat layer's) give a new object
            # to every API role: its grants start from none, as the migrations' revokes make them.
            target = ACL_TARGET.search(body)[1]  # type: ignore[index]
            body = f"REVOKE ALL ON {target} FROM anon, authenticated, service_role;\n{body.strip()}"
        found.append(Entry(mark["type"], mark["schema"], mark["name"], body.strip()))
    return found


def anchor_of(entry: Entry, owners: dict[str, str]) -> str:
    """The object an entry belongs to, as DOMAINS names it. `owners` maps an index or a sequence to
    the table it serves."""
    schema, name, kind = entry.schema, entry.name, entry.kind
    if kind == "SCHEMA" or name.startswith("SCHEMA "):
        return "schema " + name.removeprefix("SCHEMA ")
    if kind == "DEFAULT ACL":
        return "schema " + schema
    if kind in ABOUT_AN_OBJECT:
        kind, name = name.split(" ", 1)
        if kind == "COLUMN":
            name = name.split(".", 1)[0]
    elif kind in ON_A_TABLE or kind == "ROW SECURITY":
        name = name.split(" ", 1)[0]
    name = owners.get(f"{schema}.{name}", name)
    return f"{schema}.{name.split('(', 1)[0]}"


def outside_the_dump(conn: psycopg.Connection) -> dict[str, str]:
    """SQL for what the migrations create beyond `public` and `private`, by DOMAINS anchor."""
    roles = []
    for name, comment in conn.execute(
        """select r.rolname, pg_catalog.shobj_description(r.oid, 'pg_authid')
           from pg_catalog.pg_roles r where r.rolname like 'neuralgrid\\_%' order by 1"""
    ):
        roles.append(
            "do $$\nbegin\n"
            f"  if not exists (select from pg_catalog.pg_roles where rolname = '{name}') then\n"
            f"    create role {name} nologin noinherit;\n  end if;\n"
            f"  if exists (select from pg_catalog.pg_roles where rolname = 'postgres') then\n"
            f"    grant {name} to postgres;\n  end if;\nend\n$$;"
        )
        if comment:
            roles.append(f"comment on role {name} is {literal(comment)};")
    policies = []
    for schema, table, name, permissive, command, to, using, check in conn.execute(
        """select schemaname, tablename, policyname, permissive, cmd, roles, qual, with_check
           from pg_catalog.pg_policies where schemaname <> all(%s) and schemaname = 'realtime'
           order by 1, 2, 3""",
        (list(DUMPED_SCHEMAS),),
    ):
        text = f'create policy "{name}" on {schema}.{table} as {permissive.lower()} for {command.lower()}'
        text += f" to {', '.join(to)}"
        text += f"\n  using ({using})" if using else ""
        text += f"\n  with check ({check})" if check else ""
        policies.append(text + ";")
    publication = [
        f"alter publication {pub} add table only {schema}.{table};"
        for pub, schema, table in conn.execute(
            """select pubname, schemaname, tablename from pg_catalog.pg_publication_tables
               where schemaname = any(%s) order by 1, 2, 3""",
            (list(DUMPED_SCHEMAS),),
        )
    ]
    events = []
    for name, event, tags, function in conn.execute(
        """select e.evtname, e.evtevent, e.evttags, e.evtfoid::regprocedure::text
           from pg_catalog.pg_event_trigger e where e.evtname like 'neuralgrid\\_%' order by 1"""
    ):
        when = f"\n  when tag in ({', '.join(literal(t) for t in tags)})" if tags else ""
        events.append(
            f"create event trigger {name} on {event}{when}\n  execute function {function.split('(')[0]}();"
        )
    return {
        "roles": "\n\n".join(roles),
        "realtime policies": "\n\n".join(policies),
        "realtime publication": "\n".join(publication),
        "event triggers": "\n\n".join(events),
    }


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def catalog_rows(conn: psycopg.Connection) -> str:
    """The catalog tables' rows as inserts, in key order; a column that defaults to the time of the
    insert (`created_at`) takes it again."""
    inserts = []
    for table in CATALOG_TABLES:
        columns = [
            name
            for name, default in conn.execute(
                """select a.attname, pg_catalog.pg_get_expr(d.adbin, d.adrelid)
                   from pg_catalog.pg_attribute a
                   left join pg_catalog.pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum
                   where a.attrelid = %s::regclass and a.attnum > 0 and not a.attisdropped
                   order by a.attnum""",
                (table,),
            )
            if default != "now()"
        ]
        values = ", ".join(f"pg_catalog.quote_nullable({c})" for c in columns)
        for row in conn.execute(f"select {values} from {table} order by 1"):
            inserts.append(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(row)});")
    return "\n".join(inserts)


def render(url: str) -> dict[str, str]:
    """The schema files' text, by file name, for the database at `url`."""
    dump = dump_schema(url, "--no-owner")
    with psycopg.connect(url, autocommit=True) as conn:
        # An index or a sequence goes with the table it serves (a sequence with its column's table).
        owners = {
            f"{schema}.{name}": table
            for schema, name, table in conn.execute(
                """select n.nspname, c.relname, t.relname
                   from pg_catalog.pg_class c
                   join pg_catalog.pg_namespace n on n.oid = c.relnamespace
                   left join pg_catalog.pg_index i on i.indexrelid = c.oid
                   left join pg_catalog.pg_depend d on d.objid = c.oid and c.relkind = 'S'
                     and d.classid = 'pg_class'::regclass and d.refclassid = 'pg_class'::regclass
                     and d.deptype in ('a', 'i')
                   join pg_catalog.pg_class t on t.oid = coalesce(i.indrelid, d.refobjid)
                   where c.relkind in ('i', 'S') and n.nspname = any(%s)""",
                (list(DUMPED_SCHEMAS),),
            )
        }
        extra = outside_the_dump(conn)
        extra["catalog rows"] = catalog_rows(conn)

    home = {anchor: file for file, (_, *anchors) in DOMAINS.items() for anchor in anchors}
    by_anchor: dict[str, list[str]] = {}
    order: list[str] = []
    listed = entries(dump)
    for entry in listed:
        anchor = anchor_of(entry, owners)
        if anchor not in by_anchor:
            by_anchor[anchor] = []
            order.append(anchor)
    unplaced = [a for a in order if a not in home]
    if unplaced:
        raise SystemExit(
            "no schema file for "
            + ", ".join(unplaced)
            + ": add each to DOMAINS in neuralgrid/db/schema_files.py"
        )

    # A file opens with its tables; the rest keeps pg_dump's order, which is one of creation.
    tables = {anchor_of(e, owners) for e in listed if e.kind == "TABLE"}
    sequence = sorted(order, key=lambda a: a not in tables)

    def place(anchor: str) -> tuple[str, int]:
        return home[anchor], sequence.index(anchor)

    for entry in listed:
        anchor = anchor_of(entry, owners)
        if entry.kind in AFTER_WHAT_THEY_NAME:
            # After everything it names: a trigger sits with its function where that comes later
            # (`jobs_record_earning` among the earnings, `nodes_set_updated_at` with nodes), a
            # foreign key with the later of its two tables.
            named = [f"{s}.{n}" for s, n in NAMED.findall(entry.sql) if f"{s}.{n}" in home]
            anchor = max([anchor, *named], key=place)
        by_anchor[anchor].append(entry.sql)
    files: dict[str, list[str]] = {file: [] for file in DOMAINS}
    for anchor in sequence:
        files[home[anchor]].append("\n\n".join(by_anchor[anchor]))
    for anchor, sql in extra.items():
        if sql:
            files[home[anchor]].append(sql)
    return {
        f"{file}.sql": FILE_PREAMBLE.format(title=DOMAINS[file][0]) + "\n" + "\n\n\n".join(parts) + "\n"
        for file, parts in files.items()
    }


def write(url: str, target: Path = SCHEMAS_DIR) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render(url).items():
        path = target / name
        path.write_text(text)
        written.append(path)
    for stale in set(target.glob("*.sql")) - set(written):
        stale.unlink()
    return written


def schema_files(directory: Path = SCHEMAS_DIR) -> list[Path]:
    return sorted(directory.glob("*.sql"))


def apply(conn: psycopg.Connection, files: Iterable[Path]) -> None:
    """Run the schema files, in order, on a database that has the Supabase compatibility layer."""
    for path in files:
        try:
            conn.execute(path.read_text())
        except psycopg.Error as err:
            raise RuntimeError(f"{path.name}: {err}") from err


def main(argv: list[str]) -> int:
    """`write`: rebuild a database from the migrations in a scratch cluster and write the files."""
    from neuralgrid.db import migrate
    from neuralgrid.db.embedded import EmbeddedPostgres

    if argv != ["write"]:
        print("usage: python -m neuralgrid.db.schema_files write", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ng-schema-") as root:
        server = EmbeddedPostgres(Path(root), port=free_port(), fast_unsafe=True)
        server.start()
        try:
            with psycopg.connect(server.url(), autocommit=True) as conn:
                migrate.apply_compat_layer(conn)
                migrate.migrate(conn)
            for path in write(server.url()):
                print(path.relative_to(SCHEMAS_DIR.parents[1]))
        finally:
            server.stop()
    return 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
