"""Token-per-minute limits at admission (issue 16): a request is charged its estimated tokens when it
is let in, refused with 429 when that does not fit the key's minute, and settled to what it used."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import psycopg
import pytest
from openai.types.chat import ChatCompletionMessageParam

from neuralgrid.server.serving import ThreadedServer
from tests.conftest import LLAMA8, wait_for

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
Sdk = Callable[[str, str], openai.OpenAI]


def tpm_key(conn: psycopg.Connection, tpm: int) -> str:
    row = conn.execute("select api_key from create_api_key('tpm', null, %s)", (tpm,)).fetchone()
    assert row is not None
    return str(row[0])


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    """Factory: an SDK client for a gateway and key, closed after the test however it ends."""
    opened: list[openai.OpenAI] = []

    def open_sdk(base_url: str, key: str) -> openai.OpenAI:
        opened.append(openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=30))
        return opened[-1]

    yield open_sdk
    for client in opened:
        client.close()


def burst(clients: list[openai.OpenAI], count: int, max_tokens: int) -> tuple[list[int], list[Any]]:
    """`count` requests at once, spread over `clients`: the tokens each served one used, and the
    429s."""

    def call(i: int) -> Any:
        try:
            reply = clients[i % len(clients)].chat.completions.create(
                model=LLAMA8, messages=MESSAGES, max_tokens=max_tokens
            )
        except openai.RateLimitError as err:
            return err
        assert reply.usage is not None
        return reply.usage.total_tokens

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(call, range(count)))
    served = [r for r in results if isinstance(r, int)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(served) + len(refused) == count
    return served, refused


def fits(client: openai.OpenAI, max_tokens: int) -> bool:
    try:
        client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=max_tokens)
    except openai.RateLimitError:
        return False
    return True


def test_concurrent_requests_are_charged_their_estimate_at_admission(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, sdk: Sdk
) -> None:
    """The measured finding: 50 concurrent requests on a tpm-100 key all went through (2,900 tokens
    in a minute), because tokens were counted only when answers ended."""
    fake_nodes(max_concurrency=64, latency_s=0.5)  # all 50 are in flight at once
    client = sdk(gateway, tpm_key(conn, 100))
    served, refused = burst([client], 50, max_tokens=20)
    # Each is estimated at 49 tokens (its 115-byte body at 4 bytes a token, and 20 to answer): two
    # fit, and even once they are settled (29 each) a third does not.
    assert len(served) == 2 and sum(served) == 58, served
    assert conn.execute("select count(*) from jobs").fetchone() == (2,)  # the rest reached no node
    for err in refused:
        assert err.body["code"] == "rate_limit_exceeded"
        assert "tokens per minute" in err.message
        assert int(err.response.headers["retry-after"]) >= 1


def test_the_estimate_is_settled_to_the_tokens_used(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, sdk: Sdk
) -> None:
    fake_nodes(context_length=14)  # the node's context ends each answer at 14 tokens in all
    client = sdk(gateway, tpm_key(conn, 100))
    # About 80 tokens estimated (a 115-byte body, and 50 to answer): the first fits an empty minute.
    reply = client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=50)
    assert reply.usage is not None and reply.usage.total_tokens == 14
    # Its settlement gives back all but the 14 it used, so a second one fits (14 + 80 <= 100) ...
    wait_for(lambda: fits(client, 50))
    # ... and with 28 used, a third does not until the first two leave the minute.
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=50)
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 60
    # What is left still admits a smaller request (28 + 50 <= 100).
    wait_for(lambda: fits(client, 20))


def test_a_stream_is_settled_from_its_usage(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, sdk: Sdk
) -> None:
    fake_nodes(context_length=14)
    client = sdk(gateway, tpm_key(conn, 200))
    # Each holds ~85 while it runs (its body asks for usage, so it is larger), then the 14 it used:
    # without the settlement the third would not fit.
    for _ in range(4):
        stream = client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=40, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        wait_for(lambda: fits(client, 1))  # the settlement comes just after the answer's end


def test_a_request_the_node_refuses_gives_its_estimate_back(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, sdk: Sdk
) -> None:
    node = fake_nodes(failure_rate=1.0, fail_status=400)  # passed through to the client, no tokens
    client = sdk(gateway, tpm_key(conn, 100))

    def refused_by_the_node() -> bool:
        try:
            client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=50)
        except openai.RateLimitError:
            return False  # the last one's estimate is not given back yet
        except openai.BadRequestError:
            return True
        raise AssertionError("the node answered")

    for _ in range(5):  # ~80 each: were the estimates kept, the second would wait out the minute
        wait_for(refused_by_the_node)
    node.config.failure_rate = 0.0
    wait_for(lambda: fits(client, 50))


def test_a_request_larger_than_the_limit_is_charged_the_whole_minute(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, sdk: Sdk
) -> None:
    """A key with a small tpm can still make a request its limit cannot hold; that request takes the
    whole minute, and nothing else fits beside it."""
    fake_nodes(latency_s=0.5, max_concurrency=64)
    client = sdk(gateway, tpm_key(conn, 30))
    served, refused = burst([client], 5, max_tokens=40)  # each estimated ~70 > 30
    assert len(served) == 1 and len(refused) == 4


def test_a_request_no_node_takes_gives_its_estimate_back(
    conn: psycopg.Connection, gateway: str, sdk: Sdk
) -> None:
    client = sdk(gateway, tpm_key(conn, 100))
    for _ in range(3):  # no node online: 503, and no tokens used
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=50)


# Several gateways sharing Redis ---------------------------------------------------------------------


def test_gateways_sharing_redis_charge_one_minute_together(
    conn: psycopg.Connection, db_url: str, fake_nodes: Any, redis_url: str, sdk: Sdk
) -> None:
    from neuralgrid.server.app import create_app
    from neuralgrid.server.settings import Settings

    fake_nodes(max_concurrency=64, latency_s=0.5, context_length=14)
    key = tpm_key(conn, 100)
    settings = Settings(REDIS_URL=redis_url)
    with (
        ThreadedServer(create_app(settings, db_url, sweep=False)) as a,
        ThreadedServer(create_app(settings, db_url, sweep=False)) as b,
    ):
        clients = [sdk(a.url, key), sdk(b.url, key)]
        # 49 each: two fit across both gateways together, where each alone would let two in.
        served, refused = burst(clients, 20, max_tokens=20)
        assert len(served) == 2 and len(refused) == 18, served
        # Settled (14 each), the minute has room again, seen from either gateway.
        for client in clients:
            wait_for(lambda c=client: fits(c, 20))
