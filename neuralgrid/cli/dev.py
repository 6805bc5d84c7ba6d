"""`neuralgrid fake-node`: a fake OpenAI-compatible server, to try the platform without a GPU."""

from __future__ import annotations

from typing import Annotated

import typer

from neuralgrid.cli.common import fail


def fake_node(
    port: Annotated[int, typer.Option(envvar="NEURALGRID_FAKE_PORT", help="Port on 127.0.0.1.")] = 8000,
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

    if like not in LIKE:
        raise fail(f"--like {like!r}: choose one of {', '.join(LIKE)}")
    config = FakeNodeConfig.like(
        like, models=DEMO_MODELS, tokens_per_s=tokens_per_s, latency_s=latency_s, failure_rate=failure_rate
    )
    uvicorn.run(create_fake_node(config), host="127.0.0.1", port=port, log_level="warning")
