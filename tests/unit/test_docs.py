"""The docs: short, placed in time, linked, and their figures read from one source.

Each benchmark's latest run is kept as the JSON it wrote, in docs/figures/, with its date, commit and
command. The README's Benchmarks table and the tables of docs/benchmarks.md (and the heartbeats' in
docs/scaling.md) are made from those files: what lies between `<!-- figures: NAME -->` and
`<!-- /figures -->` is what `BLOCKS[NAME]` makes, and a test fails when a page says otherwise. After
a run, copy its JSON over the old one and rewrite the tables:

    cp bench-results/gateway.json docs/figures/gateway.json
    .venv/bin/python -m tests.unit.test_docs
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
FIGURES = DOCS / "figures"

README_MAX_LINES = 300
BENCHMARKS_MAX_LINES = 400
SESSION = re.compile(r"\bsessions?[ -]\d+", re.IGNORECASE)
COMMIT = re.compile(r"[0-9a-f]{7,40}(-dirty)?")
# A figure a reader could take for a measurement: a number with a unit of time or of rate.
FIGURE = re.compile(r"\d[\d,.]*\s*(?:ms|µs|requests/s|req/s)\b")
TIMES, NONE = "\N{MULTIPLICATION SIGN}", "\N{EN DASH}"
BLOCK = re.compile(r"<!-- figures: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /figures -->\n", re.S)


def pages() -> list[Path]:
    """The pages a reader is sent to: the README, CONTRIBUTING.md and docs/*.md (each must exist)."""
    return [README, CONTRIBUTING, *sorted(DOCS.glob("*.md"))]


# --- length and time --------------------------------------------------------------------------


def test_readme_is_at_most_300_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: the depth belongs in docs/"


def test_benchmarks_doc_is_at_most_400_lines() -> None:
    lines = len(BENCHMARKS.read_text().splitlines())
    assert lines <= BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md is {lines} lines: the method, the latest figures and a short history;"
        " the dated narrative stays in git's history"
    )


def test_no_page_places_anything_by_session() -> None:
    """A reader cannot place "session 22": dates and commits instead."""
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in pages()
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if SESSION.search(line)
    ]
    assert not found, "say the date and the commit:\n" + "\n".join(found)


# --- links ------------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def prose(text: str) -> str:
    """The text as it renders to words: no code blocks, code spans or comments."""
    return CODE_SPAN.sub("", FENCE.sub("", COMMENT.sub("", text)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text in lower case, without
    punctuation and symbols, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    kept = "".join(ch for ch in text if ch in "-_ " or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(text):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(page: Path) -> Iterator[str]:
    yield from LINK.findall(prose(page.read_text()))


def test_slugs_are_githubs() -> None:
    assert slug("The request path's SQL") == "the-request-paths-sql"
    assert slug("Calibration against llama.cpp") == "calibration-against-llamacpp"
    assert slug("2026-11-28 (later): grouped claims") == "2026-11-28-later-grouped-claims"
    assert slug("`neuralgrid bench` and `place_jobs()`") == "neuralgrid-bench-and-place_jobs"
    assert slug("Gateway ≤ 1 ms — the floor") == "gateway--1-ms--the-floor"


def test_every_relative_link_resolves() -> None:
    """Every link to a file of the repository finds it, and every #anchor into a page a heading."""
    broken = []
    for page in pages():
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = unquote(target).partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading makes #{anchor}")
    assert not broken, "\n".join(broken)


# --- figures ----------------------------------------------------------------------------------


@cache
def load(name: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((FIGURES / f"{name}.json").read_text())
    return report


def one(results: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The one result whose fields are these."""
    found = [r for r in results if all(r.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, f"{len(found)} results with {fields}"
    return found[0]


def dig(record: dict[str, Any], path: str) -> Any:
    """record["a"]["b"] for "a.b"; None where a step is missing."""
    value: Any = record
    for step in path.split("."):
        value = value.get(step) if isinstance(value, dict) else None
    return value


def ms(value: float | None, digits: int = 2) -> str:
    return NONE if value is None else f"{value:,.{digits}f}"


def times(a: float, b: float) -> str:
    """a as a multiple of b."""
    ratio = a / b
    return f"{ratio:.1f}{TIMES}" if ratio >= 2 else f"{ratio:.2f}{TIMES}"


def verdict(target: str, met: bool) -> str:
    return f"{target}: met" if met else f"{target}: **missed**"


def run_cell(name: str, base: str) -> str:
    report = load(name)
    return f"[{report['when'][:10]}, {report['commit']}]({base}{name}.json)"


def run_line(*names: str) -> str:
    """Where a table's figures come from: each run's date, commit and command."""
    said = []
    for name in names:
        report = load(name)
        said.append(
            f"{report['when'][:10]}, commit {report['commit']}: `{report['command']}`"
            f" ([{name}.json](figures/{name}.json))"
        )
    kept = all("source" not in load(name) for name in names)
    runs = "the run's own JSON" if len(names) == 1 else "the runs' own JSON"
    note = "" if kept else f" The figures are those the docs recorded; {runs} was not kept."
    return "Run: " + "; ".join(said) + "." + note + "\n"


def table(header: list[str], rows: list[list[str]], right: int = 0) -> str:
    """A Markdown table; the columns from `right` on are numbers, aligned right."""
    align = ["---" if i < right else "---:" for i in range(len(header))] if right else []
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align or ["---"] * len(header)) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# The gateway's peers, measured in the same run: the floor (the bare Python relay: with leases the
# gateway asks Postgres nothing on a request's path) and smg, SGLang's Rust gateway.
PEERS = (("the floor", "relay"), ("smg", "smg"))


def beside_added(result: dict[str, Any]) -> str:
    ours = result["added_p50_ms"]
    said = []
    for name, path in PEERS:
        theirs = result.get(f"{path}_added_p50_ms")
        said.append(
            f"{name}: not in this run"
            if theirs is None
            else f"{name}: {ms(theirs)} ms (ours {times(ours, theirs)})"
        )
    return "; ".join(said)


def beside_rps(results: list[dict[str, Any]]) -> str:
    said = []
    for name, path in PEERS:
        theirs = [dig(r, f"{path}.rps") for r in results]
        if None in theirs:
            said.append(f"{name}: not in this run")
            continue
        ratios = " / ".join(times(r["gateway"]["rps"], t) for r, t in zip(results, theirs, strict=True))
        said.append(f"{name}: {' / '.join(ms(t, 0) for t in theirs)} (ours {ratios})")
    return "; ".join(said)


def beside_cpu(result: dict[str, Any]) -> str:
    """The peers' CPU per request: leases off, the floor's process and Postgres, smg's process."""
    said = []
    placed = [dig(result, f"gateway_placed.{w}_cpu_ms_per_request") for w in ("gateway", "postgres")]
    if None not in placed:
        ratio = times(result["gateway"]["postgres_cpu_ms_per_request"], placed[1])
        said.append(f"leases off: {ms(placed[0])} / {ms(placed[1])} ms (Postgres ours {ratio})")
    floor = [dig(result, f"relay_sql.{w}_cpu_ms_per_request") for w in ("gateway", "postgres")]
    said += (
        [] if None in floor else [f"the relay holding a slot in Postgres: {ms(floor[0])} / {ms(floor[1])} ms"]
    )
    theirs, ours = (
        dig(result, "smg.gateway_cpu_ms_per_request"),
        result["gateway"]["gateway_cpu_ms_per_request"],
    )
    said.append(
        "smg: not in this run" if theirs is None else f"smg: {ms(theirs)} ms (ours {times(ours, theirs)})"
    )
    return "; ".join(said)


def readme_block() -> str:
    base = "docs/figures/"
    rows: list[list[str]] = []

    matching = {(r["nodes"], r["function"]): r for r in load("matching")["results"] if r["callers"] == 1}
    at10k, at100k = matching[10_000, "match_job"], matching[100_000, "match_job"]
    rows.append(
        [
            "matcher, 10,000 online nodes",
            "`match_job` p50 / p99, 1 caller",
            f"{ms(at10k['p50_ms'])} / {ms(at10k['p99_ms'])} ms",
            f"100,000 nodes: {ms(at100k['p50_ms'])} / {ms(at100k['p99_ms'])} ms",
            verdict("p99 ≤ 5 ms", at10k["p99_ms"] <= 5),
            run_cell("matching", base),
        ]
    )

    simulated = json.loads((ROOT / load("simulate")["report"]).read_text())
    policies = simulated["scenarios"]["default"]["policies"]
    ours, seed_warm = policies["balanced+prewarm"], policies["seed_warm"]
    cost = ours["supply_usd_per_mtok"] / seed_warm["supply_usd_per_mtok"]
    rows.append(
        [
            "matching, simulated (default scenario)",
            "supply cost per 1M tokens; VRAM idle per placement (`balanced+prewarm`)",
            f"${ours['supply_usd_per_mtok']:.4f}; {ours['vram_idle_gb_mean']:.1f} GB",
            f"`seed_warm`: ${seed_warm['supply_usd_per_mtok']:.4f} (ours {times(cost, 1)});"
            f" {seed_warm['vram_idle_gb_mean']:.1f} GB",
            verdict("≥ 30% cheaper; ≤ 15 GB", cost <= 0.7 and ours["vram_idle_gb_mean"] <= 15),
            run_cell("simulate", base),
        ]
    )
    sweep = simulated["sweep"]
    served = {name: p["big_model_served_pct"] for name, p in sweep["policies"].items()}
    rows.append(
        [
            "matching, simulated (scarce big nodes)",
            f"70B requests served at the load where `seed` serves {sweep['target_pct']:.0f}%",
            f"{served['balanced+prewarm']:.1f}%",
            f"`seed`: {served['seed']:.1f}%; `seed_warm`: {served['seed_warm']:.1f}%",
            verdict("≥ 99.9%", served["balanced+prewarm"] >= 99.9),
            run_cell("simulate", base),
        ]
    )

    gateway = load("gateway")["results"]
    alone = one(gateway, stream=False, callers=1)
    streams = one(gateway, stream=True, callers=1)
    loaded = [one(gateway, stream=False, callers=n) for n in (16, 64)]
    busiest = loaded[-1]
    run = run_cell("gateway", base)
    rows.append(
        [
            "gateway, sequential (default node settings, a ledger of 50,000 jobs)",
            "added p50 / p99 over the direct path",
            f"{ms(alone['added_p50_ms'])} / {ms(alone.get('added_p99_ms'))} ms",
            beside_added(alone),
            verdict("p50 ≤ 1 ms", alone["added_p50_ms"] <= 1)
            + "; "
            + verdict("p99 ≤ 5 ms", alone.get("added_p99_ms", 5.1) <= 5),
            run,
        ]
    )
    floor_and_hop = alone["relay_added_p50_ms"] + alone["agent_added_p50_ms"]
    rows.append(
        [
            "gateway + node agent, sequential",
            "added p50 over the direct path",
            f"{ms(alone['gateway_agent_added_p50_ms'])} ms",
            f"the floor and the agent's own hop: {ms(floor_and_hop)} ms"
            f" (ours {times(alone['gateway_agent_added_p50_ms'], floor_and_hop)})",
            verdict("≤ 1.5 ms", alone["gateway_agent_added_p50_ms"] <= 1.5),
            run,
        ]
    )
    agent_cpu = [dig(r, "agent.agent_cpu_ms_per_request") for r in (alone, streams)]
    rows.append(
        [
            "node agent alone, sequential",
            "added p50; CPU per request (plain / stream)",
            f"{ms(alone['agent_added_p50_ms'])} ms; {ms(agent_cpu[0])} / {ms(agent_cpu[1])} ms",
            "",
            verdict("≤ 0.5 ms", alone["agent_added_p50_ms"] <= 0.5)
            + "; "
            + verdict("≤ 0.3 ms", all(c is not None and c <= 0.3 for c in agent_cpu)),
            run,
        ]
    )
    rps = [r["gateway"]["rps"] for r in loaded]
    refused = [dig(r, "gateway.refused_503") for r in loaded]
    rows.append(
        [
            f"gateway, 16 / 64 callers on {busiest['gateway']['slots']} default slots",
            "requests/s (plain); refused (503)",
            f"{' / '.join(ms(x, 0) for x in rps)}; {' / '.join(ms(x, 0) for x in refused)}",
            beside_rps(loaded),
            verdict("≥ 1,000", max(rps) >= 1000) + "; " + verdict("0 refused", refused == [0, 0]),
            run,
        ]
    )
    cpu = busiest["gateway"]
    leases_off = dig(busiest, "gateway_placed.postgres_cpu_ms_per_request")
    rows.append(
        [
            "gateway, 64 callers (plain)",
            "CPU per request: gateway / Postgres",
            f"{ms(cpu['gateway_cpu_ms_per_request'])} / {ms(cpu['postgres_cpu_ms_per_request'])} ms",
            beside_cpu(busiest),
            verdict("Postgres ≤ 0.7 ms", cpu["postgres_cpu_ms_per_request"] <= 0.7)
            + (
                ""
                if leases_off is None
                else "; "
                + verdict(
                    f"5{TIMES} less than leases off", cpu["postgres_cpu_ms_per_request"] * 5 <= leases_off
                )
            ),
            run,
        ]
    )

    sql = {(r["group"], r["path"]): r for r in load("sql")["results"]}
    # A leased job written start and end together (`once`), where the run measured it; else apart.
    path = "once" if (14, "once") in sql else "leased"
    leased = {g: sql[g, path]["base"]["postgres_cpu_ms"] for g in (1, 14)}
    placed = {g: sql[g, "placed"]["base"]["postgres_cpu_ms"] for g in (1, 14)}
    apart = f"; start, then end: {ms(sql[14, 'leased']['base']['postgres_cpu_ms'])} ms in groups"
    rows.append(
        [
            "the request path's SQL alone, groups of 1 / 14",
            "Postgres CPU per job, leased"
            + (" (`record_jobs`: start and end in one call)" if path == "once" else " (start, then end)"),
            f"{ms(leased[1])} / {ms(leased[14])} ms",
            f"placed (`place_jobs` + `complete_jobs`): {ms(placed[1])} / {ms(placed[14])} ms (ours "
            + " / ".join(times(leased[g], placed[g]) for g in (1, 14))
            + ")"
            + (apart if path == "once" else ""),
            verdict("≤ 0.7 ms in groups", leased[14] <= 0.7)
            + "; "
            + verdict(f"5{TIMES} less than placed", all(leased[g] * 5 <= placed[g] for g in (1, 14))),
            run_cell("sql", base),
        ]
    )

    far = [r for r in load("world")["results"] if r.get("whole_added_rtt") is not None]
    # "Adds at most": a far gateway faster than the near one (it happens, by a millisecond) adds nothing.
    steady = max(r[k] for r in far for k in ("whole_added_rtt", "first_byte_added_rtt"))
    cold = {r["gateway"]: (r["cold_whole_added_rtt"], r["cold_first_byte_added_rtt"]) for r in far}
    worst = max(far, key=lambda r: r["rtt_ms"])
    fastest = max(max(r["revoked_refused_ms"], r["dead_node_avoided_ms"]) for r in far)
    rows.append(
        [
            "gateways " + " / ".join(f"{r['rtt_ms']:g}" for r in far) + " ms from Postgres",
            "added over one next to it: whole answer and first byte; cold (a new model), the farthest"
            " (varies run to run: [scaling.md](docs/scaling.md#measured-gateways-far-from-the-database))",
            f"≤ {steady if steady > 0 else 0.0:.2f} RTT; cold {cold[worst['gateway']][0]:.2f} / {cold[worst['gateway']][1]:.2f} RTT",
            f"a revoked key refused, a dead node avoided, everywhere: within {ms(fastest, 0)} ms",
            verdict("≤ 0.1 RTT", steady <= 0.1)
            + "; "
            + verdict("cold ≤ 1 RTT", all(max(c) <= 1 for c in cold.values()))
            + "; "
            + verdict("≤ 1 s", fastest <= 1000),
            run_cell("world", base),
        ]
    )

    health = load("health")["results"][0]
    killed, dropped = health["deaths"]["process killed"], health["deaths"]["tunnel dropped"]
    rows.append(
        [
            "health, agent killed",
            "offline in the database / first request served elsewhere",
            f"{ms(killed['to_offline_s'])} / {ms(killed['to_first_served_elsewhere_s'])} s",
            f"the silence that makes a node offline: {health['offline_after_silence_s']} s",
            "",
            run_cell("health", base),
        ]
    )
    rows.append(
        [
            "health, tunnel dropped",
            "offline in the database",
            f"{ms(dropped['to_offline_s'])} s",
            "",
            verdict("≤ 1 s", dropped["to_offline_s"] <= 1),
            run_cell("health", base),
        ]
    )

    capacity = load("capacity")["results"]
    few, many = (one(capacity, stream=False, callers=n) for n in (8, 64))
    three = one(load("capacity-3-gateways")["results"], stream=False, callers=64)
    slots = many["slots"]
    rows.append(
        [
            f"capacity, 2 nodes {TIMES} 4 slots, {few['callers']} / {many['callers']} callers (plain)",
            "refused (503); served",
            f"{few['refused_503']} / {many['refused_503']};"
            f" {few['served']}/{few['requests']}, {many['served']}/{many['requests']}",
            f"three gateways, {three['callers']} callers: {three['refused_503']};"
            f" {three['served']}/{three['requests']}",
            verdict("0 refused while callers ≤ slots", few["refused_503"] == 0 and few["callers"] <= slots)
            + "; "
            + verdict(f"all served at {many['callers'] // slots}{TIMES}", many["served"] == many["requests"]),
            run_cell("capacity", base),
        ]
    )
    rows.append(
        [
            f"capacity, {many['callers']} callers",
            "queue wait p50 / p99",
            f"{ms(many['queue_wait_p50_ms'], 0)} / {ms(many['queue_wait_p99_ms'], 0)} ms",
            f"three gateways: {ms(three['queue_wait_p50_ms'], 0)} / {ms(three['queue_wait_p99_ms'], 0)} ms",
            verdict("within the 30 s deadline", many["queue_wait_p99_ms"] < 30_000),
            run_cell("capacity", base),
        ]
    )
    rows.append(
        [
            f"capacity, {many['callers']} callers",
            "CPU per request: gateway / Postgres",
            f"{ms(many['gateway_cpu_ms_per_request'])} / {ms(many['postgres_cpu_ms_per_request'])} ms",
            f"three gateways: {ms(three['gateway_cpu_ms_per_request'])} /"
            f" {ms(three['postgres_cpu_ms_per_request'])} ms",
            verdict("Postgres ≤ 0.7 ms", many["postgres_cpu_ms_per_request"] <= 0.7),
            run_cell("capacity", base),
        ]
    )

    realtime = one(load("realtime")["results"], subscribers=1000)
    summary, feed = viewer("summary"), viewer("rows")
    rows.append(
        [
            f"Realtime, 1,000 subscribers, {realtime['changes_per_s']:.0f} changes/s",
            "broadcast p50 / p99; lost",
            f"{ms(realtime['p50_ms'], 1)} / {ms(realtime['p99_ms'], 1)} ms; {realtime['lost']}",
            f"a map viewer: {ms(summary['messages_per_s_per_viewer'])} messages/s (the row feed it"
            f" replaced: {ms(feed['messages_per_s_per_viewer'])})",
            verdict("p99 ≤ 200 ms", realtime["p99_ms"] <= 200)
            + "; "
            + verdict("≤ 10 messages/s a viewer", summary["messages_per_s_per_viewer"] <= 10),
            run_cell("realtime", base),
        ]
    )

    sizes = sorted(load("map")["results"], key=lambda r: r["nodes"])
    small, big = sizes[0], sizes[-1]
    rows.append(
        [
            f"the map in Chromium, {big['nodes']:,} nodes",
            "the fleet first drawn; Realtime messages/s a viewer, statuses changing",
            f"{ms(big['map_ready_ms'], 0)} ms; {ms(big['live']['messages_per_s'])}",
            f"{small['nodes']:,} nodes: {ms(small['map_ready_ms'], 0)} ms (ours"
            f" {times(big['map_ready_ms'], small['map_ready_ms'])})",
            verdict(f"≤ 2{TIMES} at {small['nodes']:,}", big["map_ready_ms"] <= 2 * small["map_ready_ms"])
            + "; "
            + verdict("≤ 10 messages/s", max(r["live"]["messages_per_s"] for r in sizes) <= 10),
            run_cell("map", base),
        ]
    )
    rows.append(verification_row(base))
    return table(["what", "measure", "figure", "beside it, same run", "target", "run"], rows)


GROSS_CHEATS = ("pruned", "sampling at 0.8", "canned")  # bench/verification.py: flagged within 3
HONEST_TARGET = 2000


def verification_row(base: str) -> list[str]:
    report = load("verification")
    nodes = {r["node"]: r for r in report["results"]}
    honest = [r for r in report["results"] if r["honest"]]
    flagged = sum(r["state"] == "failed" for r in honest)
    gross = [nodes[name]["flagged_after"] for name in GROSS_CHEATS]
    requant = nodes["requantized"]["flagged_after"]
    return [
        "model verification, real servers of SmolLM2",
        "honest nodes flagged (their challenges); cheats flagged after (challenges)",
        f"{flagged} ({report['honest_challenges']:,}); "
        + ", ".join(f"{name} {after or 'never'}" for name, after in zip(GROSS_CHEATS, gross, strict=True)),
        f"requantized {requant or 'never'}; referee CPU {ms(dig(report, 'referee_cpu_s.mean_s'))} s a challenge;"
        f" a verified node's challenges: {ms(100 * dig(report, 'cost.capacity_share_verified'), 3)}% of its time at capacity",
        verdict(f"0 over {HONEST_TARGET:,}", flagged == 0 and report["honest_challenges"] >= HONEST_TARGET)
        + "; "
        + verdict("gross ≤ 3", all(after is not None and after <= 3 for after in gross))
        + "; "
        + verdict("requantized ≤ 20", requant is not None and requant <= 20)
        + "; "
        + verdict("≤ 1%", dig(report, "cost.capacity_share_verified") <= 0.01),
        run_cell("verification", base),
    ]


def verification_block(name: str = "verification") -> str:
    """bench verify's nodes and what challenges cost; `name`: its run against a referee, or the one
    with cross-checks alone (--cross-checks)."""
    report = load(name)
    rows = [
        [
            r["node"],
            "honest" if r["honest"] else "cheat",
            r["state"],
            str(r["challenges"]),
            str(r["failed"]),
            str(r["flagged_after"] or NONE),
            NONE if r["distance_of_failures"] is None else " to ".join(map(str, r["distance_of_failures"])),
            str(r.get("paid_jobs", 0)),
            str(r.get("forfeited_jobs", 0)),
        ]
        for r in report["results"]
    ]
    head = [
        "node",
        "",
        "state",
        "challenges",
        "failed",
        "flagged after",
        "largest gap of each failure, logits",
        "paid jobs",
        "forfeited",
    ]
    cost = report["cost"]
    capacity = cost["capacity"]
    said = (
        f"A challenge cost its node {ms(cost['prompt_tokens_per_challenge'], 1)} prompt and"
        f" {ms(cost['completion_tokens_per_challenge'], 1)} answer tokens on average:"
        f" {ms(cost['node_seconds_per_challenge'], 2)} s of the honest llama-server's time at its capacity"
        f" (saturated: {ms(capacity['prompt_tokens_per_s'])} prompt tokens/s read,"
        f" {ms(capacity['completion_tokens_per_s'])} answer tokens/s written). At one per 10 minutes that is"
        f" {ms(100 * cost['capacity_share_verified'], 3)}% of its time, and"
        f" {ms(100 * cost['capacity_share_unverified'], 2)}% while unverified (one per 30 s); against what it"
        f" served under the bench's light load ({ms(cost['node_tokens_per_s_served'])} tokens/s),"
        f" {ms(100 * cost['share_verified'], 3)}%."
    )
    if report.get("referee_cpu_s"):
        said += (
            f" The referee spent {ms(dig(report, 'referee_cpu_s.mean_s'))} s of CPU a challenge (one thread)."
        )
    else:
        said += " No referee: each challenge asks the node and one or two peers."
    return table(head, rows, right=3) + "\n" + said + " " + run_line(name)


def viewer(feed: str) -> dict[str, Any]:
    """bench realtime's map viewers of a feed, at the most viewers it ran."""
    viewers = [v for v in load("realtime")["viewers"] if v["feed"] == feed]
    return max(viewers, key=lambda v: v["viewers"])


def gateway_block() -> str:
    columns: list[tuple[str, str]] = [
        ("direct p50", "direct.p50_ms"),
        ("relay adds p50", "relay_added_p50_ms"),
        ("relay_sql adds p50", "relay_sql_added_p50_ms"),
        ("agent adds p50", "agent_added_p50_ms"),
        ("gateway adds p50", "added_p50_ms"),
        ("gateway adds p99", "added_p99_ms"),
        ("gateway + agent adds p50", "gateway_agent_added_p50_ms"),
        ("smg adds p50", "smg_added_p50_ms"),
        ("req/s: the floor", "relay.rps"),
        ("req/s: relay_sql", "relay_sql.rps"),
        ("req/s: gateway", "gateway.rps"),
        ("req/s: leases off", "gateway_placed.rps"),
        ("req/s: gateway + agent", "gateway_agent.rps"),
        ("req/s: smg", "smg.rps"),
        ("gateway refused", "gateway.refused_503"),
        ("CPU per request: gateway", "gateway.gateway_cpu_ms_per_request"),
        ("CPU per request: Postgres", "gateway.postgres_cpu_ms_per_request"),
        ("CPU per request: Postgres, leases off", "gateway_placed.postgres_cpu_ms_per_request"),
        ("CPU per request: relay_sql", "relay_sql.gateway_cpu_ms_per_request"),
        ("CPU per request: smg", "smg.gateway_cpu_ms_per_request"),
        ("CPU per request: agent alone", "agent.agent_cpu_ms_per_request"),
    ]
    results = sorted(load("gateway")["results"], key=lambda r: (r["stream"], r["callers"]))
    shown = [(h, p) for h, p in columns if any(dig(r, p) is not None for r in results)]

    def cell(result: dict[str, Any], path: str) -> str:
        value = dig(result, path)
        return ms(value, 0) if path.endswith(("rps", "refused_503")) else ms(value)

    rows = [
        ["stream" if r["stream"] else "plain", str(r["callers"]), *(cell(r, p) for _, p in shown)]
        for r in results
    ]
    smg = (load("gateway").get("smg") or {}).get("version")
    peer = f"smg: {smg}. " if smg else ""
    return (
        table(["mode", "callers", *(h for h, _ in shown)], rows, right=1) + "\n" + peer + run_line("gateway")
    )


def matching_block() -> str:
    rows = []
    for r in load("matching")["results"]:
        function, _, case = r["function"].partition(", ")
        said = f"`{function}`" + (f", {case}" if case else "")
        rows.append([f"{r['nodes']:,}", said, str(r["callers"]), ms(r["p50_ms"]), ms(r["p99_ms"])])
    head = ["nodes", "function", "callers", "p50 ms", "p99 ms"]
    return table(head, rows, right=2) + "\n" + run_line("matching")


def sql_block() -> str:
    """Each group's figures by path; leased over placed; with --compare, the change and its ratio."""
    names = {
        "base": "",
        "compare": "the change",
        "ratio": "change / before",
        "leased_over_placed": "leased / placed",
    }
    rows = []
    for r in load("sql")["results"]:
        for name, said in names.items():
            if name in r:
                ratio = name in ("ratio", "leased_over_placed")
                cells = [
                    ms(r[name].get(k), 3) + (TIMES if ratio else "")
                    for k in ("first_ms", "second_ms", "postgres_cpu_ms")
                ]
                said = f"{r['path']} / placed" if name == "leased_over_placed" else said
                rows.append([str(r["group"]), r["path"], said, *cells])
    head = ["group", "path", "", "first call ms", "second call ms", "Postgres CPU ms"]
    return table(head, rows, right=3) + "\n" + run_line("sql")


def capacity_block() -> str:
    rows = []
    for name in ("capacity", "capacity-3-gateways"):
        for r in load(name)["results"]:
            rows.append(
                [
                    str(r["gateways"]),
                    "stream" if r["stream"] else "plain",
                    f"{r['callers']} on {r['slots']}",
                    f"{r['served']}/{r['requests']}",
                    str(r["refused_503"]),
                    f"{ms(r['queue_wait_p50_ms'], 0)} / {ms(r['queue_wait_p99_ms'], 0)}",
                    f"{ms(r['p50_ms'], 1)} / {ms(r['p99_ms'], 1)}",
                    ms(r["rps"], 0),
                    f"{ms(r['gateway_cpu_ms_per_request'])} / {ms(r['postgres_cpu_ms_per_request'])}",
                ]
            )
    head = [
        "gateways",
        "mode",
        "callers on slots",
        "served",
        "refused",
        "wait p50 / p99 ms",
        "p50 / p99 ms",
        "req/s",
        "CPU per request, gateways / Postgres ms",
    ]
    return table(head, rows, right=2) + "\n" + run_line("capacity", "capacity-3-gateways")


def health_block() -> str:
    result = load("health")["results"][0]
    rows = [
        [
            death,
            *(
                "never" if r[k] is None else f"{r[k]:.2f} s"
                for k in ("to_offline_s", "to_first_served_elsewhere_s", "to_first_request_avoiding_it_s")
            ),
        ]
        for death, r in result["deaths"].items()
    ]
    head = [
        "death",
        "offline in the database",
        "first request served elsewhere",
        "first request that avoids it",
    ]
    t = result["tunnel_vs_direct"]
    overhead = (
        f"Through the gateway to one node, sequentially: p50 {ms(t['tunnel']['sequential']['p50_ms'])} ms"
        f" through a tunnel against {ms(t['direct']['sequential']['p50_ms'])} ms direct; streaming at 16"
        f" callers, {ms(t['tunnel']['stream_x16_rps'], 0)} against {ms(t['direct']['stream_x16_rps'], 0)}"
        " requests/s."
    )
    return table(head, rows, right=1) + "\n" + overhead + " " + run_line("health")


def realtime_block() -> str:
    rows = [
        [
            f"{r['subscribers']:,}",
            f"{r['changes_per_s']:.0f}",
            f"{r['delivered']:,}",
            str(r["lost"]),
            ms(r["p50_ms"], 1),
            ms(r["p99_ms"], 1),
            ms(r["max_ms"], 1),
        ]
        for r in load("realtime")["results"]
    ]
    head = ["subscribers", "changes/s", "delivered", "lost", "p50 ms", "p99 ms", "max ms"]
    feeds = {"summary": "the map's summary (`map:summary`)", "rows": "every row change, as the map before"}
    seen = [
        [
            feeds[v["feed"]],
            f"{v['viewers']:,}",
            f"{v['changes_per_s']:.0f}",
            ms(v["messages_per_s_per_viewer"]),
            ms(v["bytes_per_s_per_viewer"], 0),
        ]
        for v in load("realtime").get("viewers", [])
    ]
    viewers = ["map viewers of", "viewers", "changes/s", "messages/s each", "bytes/s each"]
    return (
        table(head, rows, right=1)
        + "\n"
        + (table(viewers, seen, right=1) + "\n" if seen else "")
        + run_line("realtime")
    )


def heartbeats_block() -> str:
    """Each part of the run; then the targets, as the run's summary has them."""
    report = load("heartbeats")
    rows = [
        [
            "a gateway" if r["path"] == "gateway" else "SQL alone",
            r["code"],
            f"{r['nodes']:,}",
            f"{ms(r['offered_beats_per_s'], 0)} / {ms(r['beats_per_s'], 0)}",
            ms(r["postgres_cpu_us_per_beat"], 1),
            ms(r.get("gateway_cpu_us_per_beat"), 1),
            ms(r["wal_bytes_per_beat"], 0),
            ms(r["nodes_per_postgres_core"], 0),
            f"{ms(r['match_p99_ms'])} / {ms(r['quiet_match_p99_ms'])}",
        ]
        for r in report["results"]
    ]
    head = [
        "path",
        "code",
        "nodes",
        "beats/s offered / delivered",
        "Postgres CPU µs per beat",
        "gateway CPU µs per beat",
        "WAL bytes per beat",
        "nodes per Postgres core",
        "`match_job` p99 under beats / quiet ms",
    ]
    said = report["summary"]
    summary = (
        f"A batched beat's Postgres CPU over a beat written at once: {said['batched_over_per_beat_cpu_gateway']:.3f}"
        f"{TIMES} through the gateway, {said['batched_over_per_beat_cpu_sql']:.3f}{TIMES} in SQL alone,"
        f" {said['batched_over_before_cpu_sql']:.4f}{TIMES} the code before issue 41's; beats the batching"
        f" gateway delivered over those offered: {said['delivered_over_offered']:.3f}; `match_job` p99 under"
        f" batched beats over quiet: {said['match_p99_under_beats_over_quiet_sql']:.2f}{TIMES} in SQL alone,"
        f" {said['match_p99_under_beats_over_quiet_gateway']:.2f}{TIMES} through the gateway (whose HTTP"
        f" shares the two cores; in Postgres alone {said['match_pg_p99_under_beats_over_quiet_gateway']:.2f}"
        f"{TIMES}), {said['match_p99_under_beats_over_quiet_at_scale']:.2f}{TIMES} at"
        f" {max(r['nodes'] for r in report['results']):,} nodes."
    )
    return table(head, rows, right=2) + "\n" + summary + " " + run_line("heartbeats")


def map_block() -> str:
    """The map in Chromium at each fleet size (bench map), then its viewers on Realtime (bench realtime)."""
    results = sorted(load("map")["results"], key=lambda r: r["nodes"])
    rows = [
        [
            f"{r['nodes']:,}",
            ms(r["first_paint_ms"], 0),
            ms(r["first_contentful_paint_ms"], 0),
            f"{ms(r['map_ready_ms'], 0)} ({times(r['map_ready_ms'], results[0]['map_ready_ms'])})",
            ms(r["js_heap_mb"], 1),
            f"{r['dom_elements']:,}",
            ms(r["json_kb"], 1),
            f"{ms(r['live']['messages_per_s'])} ({ms(r['live']['bytes_per_s'], 0)})",
            " / ".join(ms(r["live"][f"{k}postgres_cpu_ms_per_s"], 0) for k in ("", "quiet_", "unwatched_")),
        ]
        for r in results
    ]
    changing = f"{results[0]['live']['changes_per_s']:.0f}"
    head = [
        "nodes",
        "first paint ms",
        "first contentful paint ms",
        f"fleet drawn ms (over {results[0]['nodes']:,})",
        "JS heap MB",
        "DOM elements",
        "JSON read KB",
        f"Realtime messages/s (bytes/s), {changing} statuses/s changing",
        "Postgres CPU ms/s: changing / at rest / no viewer",
    ]
    summary, feed = viewer("summary"), viewer("rows")
    said = (
        f"{summary['viewers']} map viewers at {summary['changes_per_s']:.0f} status changes a second"
        f" (`bench realtime`): {ms(summary['messages_per_s_per_viewer'])} messages and"
        f" {ms(summary['bytes_per_s_per_viewer'], 0)} bytes a second each on the summary, against"
        f" {ms(feed['messages_per_s_per_viewer'])} and {ms(feed['bytes_per_s_per_viewer'], 0)} on the"
        " row feed the map heard before."
    )
    return table(head, rows, right=1) + "\n" + said + " " + run_line("map", "realtime")


def sse_block() -> str:
    result = load("sse")["results"][0]
    rows = [[r["shape"], ms(r["cpu_ms"], 1), ms(r["cpu_ms_per_mib"], 1)] for r in result["shapes"]]
    ratio = f"A 15 MiB event in 64 KiB pieces over the same in one read: {result['pieces_over_whole']:.2f}{TIMES}."
    return table(["stream", "CPU ms", "ms per MiB"], rows, right=1) + "\n" + ratio + " " + run_line("sse")


def gpu_probe_block() -> str:
    """The GPU probe on a real GPU, idle and beside another process's load (scripts/gpu_calibration.sh)."""
    report = load("gpu-probe")
    rows = [
        [
            "nothing" if r["beside"] == "none" else f"a {r['beside']}-bound load",
            f"{r['bytes'] / 2**30:.1f} GiB",
            f"{r['make_gbps']:,.0f} GB/s",
            f"{r['digest_s'] * 1000:,.0f} ms",
            f"{r['gbps']:,.0f} GB/s",
            f"{r['share_of_datasheet']:.0%}",
        ]
        for r in report["results"]
    ]
    half = report["holding_half"]["gbps"]
    datasheet = report["results"][0]["datasheet_gbps"]
    head = ["beside the probe", "filled", "blocks made", "4 passes of digests", "bandwidth", "of datasheet"]
    return (
        f"{report['device']}, datasheet {datasheet:,.0f} GB/s:\n\n"
        + table(head, rows, right=1)
        + f"\nHolding half the fill and making the rest again in every pass: {half:,} GB/s"
        f" ({half / datasheet:.0%}).\n\n" + run_line("gpu-probe")
    )


BLOCKS: dict[str, Callable[[], str]] = {
    "readme": readme_block,
    "gateway": gateway_block,
    "matching": matching_block,
    "sql": sql_block,
    "capacity": capacity_block,
    "health": health_block,
    "realtime": realtime_block,
    "map": map_block,
    "heartbeats": heartbeats_block,
    "sse": sse_block,
    "verification": verification_block,
    "cross_checks": functools.partial(verification_block, "cross_checks"),
    "gpu-probe": gpu_probe_block,
}
# The heartbeats' and Realtime's figures stand beside their design, the map's beside its page
# (docs/benchmarks.md points to each); the others are in docs/benchmarks.md.
WHERE = {
    "readme": README,
    "heartbeats": DOCS / "scaling.md",
    "realtime": DOCS / "realtime.md",
    "map": DOCS / "web.md",
    "verification": DOCS / "security.md",
    "cross_checks": DOCS / "security.md",
    "gpu-probe": DOCS / "security.md",
}


def made(text: str) -> str:
    """The page with each figures block as its files make it."""
    return BLOCK.sub(
        lambda m: f"<!-- figures: {m['name']} -->\n{BLOCKS[m['name']]()}<!-- /figures -->\n", text
    )


def test_each_figure_file_says_when_where_and_how() -> None:
    for path in sorted(FIGURES.glob("*.json")):
        report = json.loads(path.read_text())
        assert re.fullmatch(r"\d{4}-\d\d-\d\d(T[\d:]+([+-]\d\d:\d\d|Z)?)?", report["when"]), path.name
        assert COMMIT.fullmatch(report["commit"]), f"{path.name}: the commit it measured"
        assert report["command"].startswith("neuralgrid "), f"{path.name}: the command that wrote it"
        assert "results" in report or (ROOT / report["report"]).exists(), path.name


def test_figures_on_the_pages_are_made_from_their_files() -> None:
    """One source: each block of figures in README.md and docs/benchmarks.md is what docs/figures
    makes (rewrite them with `python -m tests.unit.test_docs`)."""
    for name, _ in BLOCKS.items():
        page = WHERE.get(name, BENCHMARKS)
        blocks = {m["name"]: m["body"] for m in BLOCK.finditer(page.read_text())}
        assert name in blocks, f"{page.relative_to(ROOT)} has no <!-- figures: {name} --> block"
        assert blocks[name] == BLOCKS[name](), f"{page.relative_to(ROOT)}: block {name} is stale"


def section(page: Path, title: str) -> str:
    text = page.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_readme_states_figures_only_in_its_table() -> None:
    """Known limits and the words around the table state no figure the table could contradict."""
    for title in ("Benchmarks", "Known limits"):
        words = BLOCK.sub("", section(README, title))
        assert not FIGURE.findall(words), f"README's {title} states {FIGURE.findall(words)}"


def test_a_benchmark_report_says_when_and_on_which_commit(tmp_path: Path) -> None:
    from neuralgrid.bench import write_report

    write_report(tmp_path / "bench.json", "bench", [{"p50_ms": 1.0}])
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["when"]
    assert COMMIT.fullmatch(report["commit"]), report["commit"]
    assert report["command"]


if __name__ == "__main__":
    for page in (README, BENCHMARKS, *sorted(set(WHERE.values()) - {README})):
        page.write_text(made(page.read_text()))
        print(f"wrote {page.relative_to(ROOT)}'s figures from {FIGURES.relative_to(ROOT)}/")
