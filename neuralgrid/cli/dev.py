"""`neuralgrid fake-node`: a fake OpenAI-compatible server, to try the platform without a GPU."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from neuralgrid.cli.common import fail, out


def fake_node(
    port: Annotated[
        int, typer.Option(envvar="NEURALGRID_FAKE_PORT", help="Port on 127.0.0.1 (0: any free one).")
    ] = 8000,
    tokens_per_s: Annotated[
        float, typer.Option(envvar="NEURALGRID_FAKE_TOKENS_PER_S", help="Generation speed (0: instant).")
    ] = 0.0,
    latency_s: Annotated[
        float, typer.Option(envvar="NEURALGRID_FAKE_LATENCY_S", help="Delay before the first byte.")
    ] = 0.0,
    failure_rate: Annotated[
        float, typer.Option(envvar="NEURALGRID_FAKE_FAILURE_RATE", help="Share of requests answered 500.")
    ] = 0.0,
    like: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_FAKE_LIKE",
            help="Behave like vllm, llama.cpp or llama-cpp-python, as the conformance suite measured them.",
        ),
    ] = "vllm",
) -> None:
    """Serve a fake OpenAI-compatible inference server (for trying the platform without a GPU)."""
    import uvicorn

    from neuralgrid.dev.demo import DEMO_MODELS
    from neuralgrid.dev.fakenode import LIKE, FakeNodeConfig, create_fake_node
    from neuralgrid.server.run import listen
    from neuralgrid.server.serving import run_fast

    if like not in LIKE:
        raise fail(f"--like {like!r}: choose one of {', '.join(LIKE)}")
    if not 0 <= port <= 65535:
        raise fail(f"--port {port}: a TCP port is 1 to 65535 (0: any free one)")
    try:
        listener = listen("127.0.0.1", port)  # bound first: a taken port fails here, in one line
    except OSError as err:
        raise fail(f"--port {port}: cannot listen there ({err.strerror or err})") from err
    config = FakeNodeConfig.like(
        like, models=DEMO_MODELS, tokens_per_s=tokens_per_s, latency_s=latency_s, failure_rate=failure_rate
    )
    bound = listener.getsockname()[1]
    out.print(f"a fake {like} server on http://127.0.0.1:{bound}/v1 (Ctrl-C stops it)", highlight=False)
    server = uvicorn.Server(uvicorn.Config(create_fake_node(config), log_level="warning"))
    with contextlib.suppress(KeyboardInterrupt):
        run_fast(server.serve(sockets=[listener]))
