"""`neuralgrid node run`: the agent a GPU owner runs next to an inference server.

Only the agent's dependencies are imported here: a node owner's install has no server packages.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Annotated

import typer

from neuralgrid.cli.common import fail, log_to_stderr

app = typer.Typer(no_args_is_help=True, help="Run a GPU node: the agent a GPU owner runs.")
# Panels are tables of their own, so no column is shared with the widest option of another panel:
# that keeps every env var name whole at 80 columns.
REACH = "How the gateway reaches the agent"
HARDWARE = "Hardware (when NVML cannot tell)"
MAP = "Location on the map"


def _concurrency(value: int | None) -> int | None:
    """1 to 1024. Checked here, not by min/max, which typer would print in a column too wide for 80."""
    if value is not None and not 1 <= value <= 1024:
        raise typer.BadParameter(f"{value} is not in the range 1 to 1024")
    return value


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
        float, typer.Option(envvar="NEURALGRID_NODE_PRICE", help="Your price, USD per hour.")
    ] = 0.5,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            envvar="NEURALGRID_NODE_MAX_CONCURRENCY",
            callback=_concurrency,
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
        typer.Option(envvar="NEURALGRID_VRAM_GB", rich_help_panel=HARDWARE, help="Total VRAM, GB."),
    ] = None,
    tflops: Annotated[
        float | None,
        typer.Option(envvar="NEURALGRID_TFLOPS", rich_help_panel=HARDWARE, help="Dense FP16 TFLOPS."),
    ] = None,
    latitude: Annotated[
        float | None,
        typer.Option(envvar="NEURALGRID_NODE_LATITUDE", rich_help_panel=MAP, help="For the map."),
    ] = None,
    longitude: Annotated[
        float | None,
        typer.Option(envvar="NEURALGRID_NODE_LONGITUDE", rich_help_panel=MAP, help="For the map."),
    ] = None,
    tunnel: Annotated[
        bool,
        typer.Option(
            envvar="NEURALGRID_NODE_TUNNEL",
            rich_help_panel=REACH,
            help="Dial out to the gateway (behind NAT: no open port).",
        ),
    ] = False,
) -> None:
    """Join the grid: detect the GPU, register with the gateway, heartbeat; SIGTERM drains."""
    import socket

    from neuralgrid.agent.backend import BackendError, parse_aliases
    from neuralgrid.agent.run import Agent, AgentConfig, AgentError

    try:
        aliases = parse_aliases(model_alias or [])
    except BackendError as err:
        raise fail(str(err)) from err
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
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await Agent(config).run(stop)

    try:
        asyncio.run(main())
    except AgentError as err:
        raise fail(str(err)) from err
