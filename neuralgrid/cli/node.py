"""`neuralgrid node run`: the agent a GPU owner runs next to an inference server; `neuralgrid node
earnings`: what the owner's nodes earned and how their models fare under verification; `neuralgrid
node verify`: ask again for a node's failed models to be verified. The last two ask the gateway with
the owner's API key, or a hosted project's Data API as the owner `neuralgrid login` signed in.

Only the agent's dependencies are imported here: a node owner's install has no server packages.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich import box
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from neuralgrid.cli import gpu_probe
from neuralgrid.cli.account import hosted_errors, signed_in
from neuralgrid.cli.common import fail, log_to_stderr, out
from neuralgrid.protocol.nodes import NodeRegistration

app = typer.Typer(no_args_is_help=True, help="Run a GPU node: the agent a GPU owner runs.")
# Panels are tables of their own, so no column is shared with the widest option of another panel:
# that keeps every env var name whole at 80 columns.
REACH = "How the gateway reaches the agent"
HARDWARE = "Hardware (when NVML cannot tell)"
MAP = "Location on the map"
app.command("probe-gpu")(gpu_probe.probe_gpu)


def _within(low: float, high: float, low_open: bool = False) -> Callable[[Any], Any]:
    """A callback that refuses a flag's value outside [low, high] (low excluded when low_open) at
    once, by the flag's name: the registration would refuse it only after the server's warm-up.
    Checked here, not by typer's min/max, which it prints in a column too wide for 80."""
    below = f"greater than {low:g}" if low_open else f"at least {low:g}"

    def check(value: Any) -> Any:
        if value is not None and not ((low < value if low_open else low <= value) and value <= high):
            raise typer.BadParameter(f"{value:g} is not in range: {below}, at most {high:g}")
        return value

    return check


def _as_registered(field: str) -> Callable[[Any], Any]:
    """_within() the range the gateway's registration accepts for `field` (its pydantic bounds)."""
    bounds = {type(rule).__name__: rule for rule in NodeRegistration.model_fields[field].metadata}
    if "Gt" in bounds:
        return _within(bounds["Gt"].gt, bounds["Le"].le, low_open=True)
    return _within(bounds["Ge"].ge, bounds["Le"].le)


@app.command("run")
def run(
    gateway: Annotated[str, typer.Option(envvar="NEURALGRID_GATEWAY_URL", help="The gateway's URL.")],
    token: Annotated[str, typer.Option(envvar="NEURALGRID_NODE_TOKEN", help="Your operator API key.")],
    backend: Annotated[
        str,
        typer.Option(envvar="NEURALGRID_BACKEND_URL", help="Your OpenAI-compatible server (vLLM, Ollama…)."),
    ],
    name: Annotated[
        str | None, typer.Option(envvar="NEURALGRID_NODE_NAME", help="Node name (default: host).")
    ] = None,
    region: Annotated[
        str, typer.Option(envvar="NEURALGRID_NODE_REGION", help="Region, e.g. eu-west.")
    ] = "unknown",
    price: Annotated[
        float,
        typer.Option(
            callback=_as_registered("hourly_rate"),
            envvar="NEURALGRID_NODE_PRICE",
            help="Your price, USD per hour.",
        ),
    ] = 0.5,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            envvar="NEURALGRID_NODE_MAX_CONCURRENCY",
            callback=_as_registered("max_concurrency"),
            help="Requests at once, 1 to 1024 (default: what the server runs at once, when it says; else 4).",
        ),
    ] = None,
    model_alias: Annotated[
        list[str] | None,
        typer.Option(
            "--model-alias",
            envvar="NEURALGRID_NODE_MODEL_ALIASES",
            help="SERVED=CATALOG: serve the model the server calls SERVED as the catalog's CATALOG"
            " (its price and VRAM apply). Repeat for several.",
        ),
    ] = None,
    listen_port: Annotated[
        int,
        typer.Option(
            envvar="NEURALGRID_NODE_PORT",
            callback=_within(1, 65_535),
            rich_help_panel=REACH,
            help="Port the agent listens on (direct mode).",
        ),
    ] = 8001,
    public_url: Annotated[
        str | None,
        typer.Option(
            envvar="NEURALGRID_NODE_PUBLIC_URL",
            rich_help_panel=REACH,
            help="How the gateway reaches this agent.",
        ),
    ] = None,
    gpu_model: Annotated[
        str | None,
        typer.Option(envvar="NEURALGRID_GPU_MODEL", rich_help_panel=HARDWARE, help="GPU model (no NVML)."),
    ] = None,
    vram_gb: Annotated[
        float | None,
        typer.Option(
            callback=_as_registered("vram_gb"),
            envvar="NEURALGRID_VRAM_GB",
            rich_help_panel=HARDWARE,
            help="Total VRAM, GB.",
        ),
    ] = None,
    tflops: Annotated[
        float | None,
        typer.Option(
            callback=_as_registered("tflops"),
            envvar="NEURALGRID_TFLOPS",
            rich_help_panel=HARDWARE,
            help="Dense FP16 TFLOPS.",
        ),
    ] = None,
    latitude: Annotated[
        float | None,
        typer.Option(
            callback=_as_registered("latitude"),
            envvar="NEURALGRID_NODE_LATITUDE",
            rich_help_panel=MAP,
            help="For the map.",
        ),
    ] = None,
    longitude: Annotated[
        float | None,
        typer.Option(
            callback=_as_registered("longitude"),
            envvar="NEURALGRID_NODE_LONGITUDE",
            rich_help_panel=MAP,
            help="For the map.",
        ),
    ] = None,
    tunnel: Annotated[
        bool,
        typer.Option(
            envvar="NEURALGRID_NODE_TUNNEL",
            rich_help_panel=REACH,
            help="Dial out to the gateway (behind NAT: no open port).",
        ),
    ] = False,
    routes: Annotated[
        str | None,
        typer.Option(
            envvar="NEURALGRID_NODE_ROUTES",
            help="The OpenAI routes to serve, comma-separated (chat/completions, completions, embeddings,"
            " responses, rerank, score, audio/transcriptions, audio/translations, audio/speech);"
            " default: those the server is found to serve.",
        ),
    ] = None,
    heartbeat_url: Annotated[
        str | None,
        typer.Option(
            envvar="NEURALGRID_NODE_HEARTBEAT_URL",
            rich_help_panel=REACH,
            help="Send heartbeats here instead of to the gateway: a Supabase project's `heartbeat`"
            " Edge Function (https://<ref>.supabase.co/functions/v1/heartbeat), so that the node"
            " stays alive through Supabase alone once registered.",
        ),
    ] = None,
) -> None:
    """Join the grid: detect the GPU, register with the gateway, heartbeat; SIGTERM drains."""
    import socket

    from neuralgrid.agent.backend import parse_aliases
    from neuralgrid.agent.run import Agent, AgentConfig, AgentError
    from neuralgrid.agent.servers.base import BackendError
    from neuralgrid.protocol.routes import parse_routes

    try:
        aliases = parse_aliases(model_alias or [])
        served = parse_routes(routes) if routes is not None else None
    except BackendError as err:
        raise fail(str(err)) from err
    except ValueError as err:
        raise fail(f"--routes: {err}") from err
    log_to_stderr()
    config = AgentConfig(
        gateway_url=gateway,
        token=token,
        backend_url=backend,
        name=name or socket.gethostname(),
        region=region,
        price_usd_per_hour=price,
        max_concurrency=max_concurrency,
        listen_port=listen_port,
        public_url=public_url,
        gpu_model=gpu_model,
        vram_gb=vram_gb,
        tflops=tflops,
        latitude=latitude,
        longitude=longitude,
        tunnel=tunnel,
        model_aliases=aliases,
        routes=served,
        heartbeat_url=heartbeat_url,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await Agent(config).run(stop)

    from neuralgrid.server.serving import run_fast

    try:
        run_fast(main())  # on uvloop: its event loop and transports cost a fraction of asyncio's
    except AgentError as err:
        raise fail(str(err)) from err


# Earnings ------------------------------------------------------------------------------------------

MAX_DAYS = 3660


def _days(value: int) -> int:
    """One line, not typer's usage box, for a period out of range."""
    if not 1 <= value <= MAX_DAYS:
        raise fail(f"--days takes 1 to {MAX_DAYS} (today and the days before it), not {value}")
    return value


def _usd(value: float) -> str:
    """Cents from one cent up; below that, enough decimals to show a single job's share."""
    return f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.6f}"


def _ask_gateway(
    gateway: str,
    token: str,
    path: str,
    params: dict[str, Any] | None = None,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The gateway's JSON for the owner's API key: a GET, or a POST of `body`; its refusal in one line."""
    import httpx

    from neuralgrid.protocol.routes import root_url

    url = f"{root_url(gateway)}{path}"
    headers = {"authorization": f"Bearer {token}"}
    try:
        if body is None:
            reply = httpx.get(url, params=params, headers=headers, timeout=30)
        else:
            reply = httpx.post(url, json=body, headers=headers, timeout=30)
    except httpx.HTTPError as err:
        raise fail(f"cannot reach the gateway at {gateway}: {err}") from err
    try:
        answer: dict[str, Any] = reply.json()
    except ValueError as err:
        raise fail(
            f"the gateway at {gateway} answered {reply.status_code} without JSON: is it a gateway?"
        ) from err
    if reply.status_code >= 400:
        message = (answer.get("error") or {}).get("message") or reply.reason_phrase
        raise fail(f"the gateway refused ({reply.status_code}): {message}")
    return answer


Sums = tuple[int, float, float, float]  # jobs, charged, fee, earned


def _sums(rows: list[dict[str, Any]]) -> Sums:
    return (
        sum(r["jobs"] for r in rows),
        sum(r["gross_usd"] for r in rows),
        sum(r["fee_usd"] for r in rows),
        sum(r["net_usd"] for r in rows),
    )


def _per_node_and_model(by_day: list[dict[str, Any]]) -> list[tuple[str, Sums, list[tuple[str, Sums]]]]:
    """The period's days summed per node (by name) and, within each node, per model."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in by_day:
        grouped.setdefault(row["node_name"] or f"(deleted {str(row['node_id'])[:8]})", []).append(row)
    result = []
    for name, rows in sorted(grouped.items()):
        models = sorted({r["model_id"] for r in rows})
        per_model = [(m, _sums([r for r in rows if r["model_id"] == m])) for m in models]
        result.append((name, _sums(rows), per_model))
    return result


@app.command("earnings")
@hosted_errors
def earnings(
    ctx: typer.Context,
    gateway: Annotated[
        str | None,
        typer.Option(envvar="NEURALGRID_GATEWAY_URL", help="The gateway's URL (not when signed in)."),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="NEURALGRID_NODE_TOKEN",
            help="Your API key, the one your nodes run with (not when signed in).",
        ),
    ] = None,
    days: Annotated[
        int,
        typer.Option(
            envvar="NEURALGRID_EARNINGS_DAYS", callback=_days, help="The period: the last N days (UTC)."
        ),
    ] = 30,
) -> None:
    """What your nodes earned over a period, per node and model, after the platform's fee.

    Asked of the gateway with your API key (--gateway, --token), or, signed in to a hosted project
    with `neuralgrid login`, of its Data API."""
    if (gateway is None) != (token is None):
        raise fail("--gateway and --token go together: the gateway, and your API key for it")
    if gateway is not None and token is not None:  # said explicitly: the gateway, signed in or not
        data = _ask_gateway(gateway, token, "/api/my/earnings", params={"days": days})
    elif (api := signed_in(ctx)) is not None:
        data = api.earnings(days)
    else:
        raise fail(NEEDS_GATEWAY_OR_LOGIN)
    _print_earnings(data, days)


NEEDS_GATEWAY_OR_LOGIN = (
    "--gateway and --token are needed (your API key, the one your nodes run with), or sign in"
    " to the hosted project first with `neuralgrid login`"
)


def _print_earnings(data: dict[str, Any], days: int) -> None:
    if not data["nodes"]:
        raise fail("you have no nodes: connect one with `neuralgrid node run`, using a key of yours")
    totals = data["totals"]
    checks: list[dict[str, Any]] = data.get("checks", [])  # a gateway from before verification has none
    # Nothing earned is no error when verification has something to say: an owner whose earnings were
    # all forfeited needs to see why.
    if not data["by_day"] and not checks:
        count = len(data["nodes"])
        raise fail(f"no earnings in the last {days} days: none of your {count} nodes served a paid job")
    if data["by_day"]:
        _print_earnings_table(data, days)
    else:
        out.print(f"No earnings in the last {days} days (forfeited ones aside)", highlight=False)
    if "held_usd" in totals:
        held, forfeited = _usd(totals["held_usd"]), _usd(totals["forfeited_usd"])
        out.print(
            f"held: ${held} not settled yet: forfeited if its model fails verification", highlight=False
        )
        out.print(
            f"forfeited: ${forfeited} by models that failed verification (not in the total)", highlight=False
        )
    if "checks" in data:
        _print_checks(checks)


def _print_earnings_table(data: dict[str, Any], days: int) -> None:
    out.print(
        f"Earnings of your nodes over the last {days} days (UTC), from {data['first_day']}", highlight=False
    )
    # A line per node with its sums, its models indented under it: the one wide column fits a model
    # id at 80 columns, and a long one folds rather than being cut.
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("node / model", overflow="fold")
    for header in ("jobs", "charged $", "fee $", "earned $"):
        table.add_column(header, justify="right", no_wrap=True)

    def add(label: str, sums: Sums, style: str | None = None) -> None:
        jobs, gross, fee, net = sums
        table.add_row(label, str(jobs), _usd(gross), _usd(fee), _usd(net), style=style)

    for node, node_sums, per_model in _per_node_and_model(data["by_day"]):
        add(node, node_sums, style="bold")
        for model, sums in per_model:
            add(f"  {model}", sums)
    totals = data["totals"]
    table.add_section()
    add("total", (totals["jobs"], totals["gross_usd"], totals["fee_usd"], totals["net_usd"]), style="bold")
    out.print(table)
    out.print(f"platform fee: {data['fee_rate'] * 100:g}% of what developers were charged", highlight=False)


def _print_checks(checks: list[dict[str, Any]]) -> None:
    """Each (node, model) under verification: its state, challenges passed and failed, since when, and
    under it the last failure's reason."""
    if not checks:
        out.print("verification: none of your nodes holds a model the platform checks", highlight=False)
        return
    from neuralgrid.cli.fleet import heartbeat_age

    out.print("\nVerification of your nodes' models (the platform's challenges)", highlight=False)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("node / model", overflow="fold")
    table.add_column("state", no_wrap=True)
    for header in ("passed", "failed"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("since", no_wrap=True)
    now = datetime.now(UTC)
    shown_node = None
    for check in checks:
        if check["node_name"] != shown_node:
            shown_node = check["node_name"]
            table.add_row(shown_node, style="bold")
        failed = check["failures"]
        since = heartbeat_age(_when(check["state_since"]), now)
        state = f"[red]{check['state']}[/]" if check["state"] == "failed" else check["state"]
        table.add_row(f"  {check['model_id']}", state, str(check["challenges"] - failed), str(failed), since)
        if check["last_failure"]:  # its own row, indented as a whole however it wraps
            table.add_row(Padding(Text(f"last failure: {check['last_failure']}", style="dim"), (0, 0, 0, 4)))
    out.print(table, highlight=False)
    if any(c["state"] == "failed" for c in checks):
        out.print(
            "fix a failed model's server, then ask again: `neuralgrid node verify NODE`", highlight=False
        )


def _when(value: datetime | str) -> datetime:
    """A time as the hosted path reads it (a datetime) or as the gateway's JSON has it (ISO 8601)."""
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)


# Asking again ----------------------------------------------------------------------------------------


@app.command("verify")
@hosted_errors
def verify(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="The name (or id) of your node.")],
    gateway: Annotated[
        str | None,
        typer.Option(envvar="NEURALGRID_GATEWAY_URL", help="The gateway's URL (not when signed in)."),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="NEURALGRID_NODE_TOKEN",
            help="Your API key, the one your nodes run with (not when signed in).",
        ),
    ] = None,
) -> None:
    """Ask for your node's failed models to be verified again, once you fixed its server.

    Each failed model starts over, unverified, and is challenged at once; what was forfeited stays
    forfeited. Asked of the gateway with your API key (--gateway, --token), or, signed in to a hosted
    project with `neuralgrid login`, of its Data API."""
    if (gateway is None) != (token is None):
        raise fail("--gateway and --token go together: the gateway, and your API key for it")
    if gateway is not None and token is not None:
        started = _ask_gateway(gateway, token, "/api/my/verification", body={"node": node})
    elif (api := signed_in(ctx)) is not None:
        started = api.request_verification(node)
    else:
        raise fail(NEEDS_GATEWAY_OR_LOGIN)
    for model in started["models"]:
        out.print(
            f"{started['node_name']}: {model['model_id']} starts over, {model['state']}", highlight=False
        )
    out.print("it gets requests again, and is challenged at once", highlight=False)
