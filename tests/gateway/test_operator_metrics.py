"""What an operator reads on /metrics beyond the HTTP counters: per model jobs, tokens, cost, time to
first token and per output token (vLLM's names for the latencies), and the fleet's gauges."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import LLAMA8, make_node, wait_for
from tests.slots import written_behind

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def scrape(gateway: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on /metrics, by name and labels."""
    text = httpx.get(f"{gateway}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_jobs_tokens_cost_and_stream_latencies_per_model(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    fake_nodes(latency_s=0.05)
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=0) as sdk:
        plain = sdk.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=5)
        chunks = list(
            sdk.chat.completions.create(
                model=LLAMA8,
                messages=MESSAGES,
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    streamed = chunks[-1].usage
    assert plain.usage is not None and streamed is not None
    wait_for(lambda: conn.execute("select count(*) from jobs where status = 'succeeded'").fetchone() == (2,))
    cost = conn.execute("select sum(cost_usd)::float8 from jobs").fetchone()
    assert cost is not None
    seen = scrape(gateway)
    model = (("model", LLAMA8),)
    assert seen[("neuralgrid_jobs_total", (("model", LLAMA8), ("outcome", "succeeded")))] == 2
    completion = plain.usage.completion_tokens + streamed.completion_tokens
    prompt = plain.usage.prompt_tokens + streamed.prompt_tokens
    assert seen[("neuralgrid_tokens_total", (("model", LLAMA8), ("type", "completion")))] == completion
    assert seen[("neuralgrid_tokens_total", (("model", LLAMA8), ("type", "prompt")))] == prompt
    assert abs(seen[("neuralgrid_cost_usd_total", model)] - cost[0]) < 1e-9 and cost[0] > 0
    # Streams only: a plain answer's first byte is its last.
    assert seen[("neuralgrid_time_to_first_token_seconds_count", model)] == 1
    assert seen[("neuralgrid_time_to_first_token_seconds_sum", model)] >= 0.05  # the node's think time
    assert seen[("neuralgrid_time_per_output_token_seconds_count", model)] == 1


def test_every_gap_between_streamed_tokens_is_observed(fake_nodes: Any, gateway: str, api_key: str) -> None:
    """vLLM's inter_token_latency: one observation per token after the first, each the wait the
    client saw (a node sending 50 tokens/s: 20 ms each), not one average per stream."""
    fake_nodes(tokens_per_s=50)
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=0) as sdk:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in sdk.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=12, stream=True)
            if c.choices
        )
    assert len(text.split()) == 12
    seen = scrape(gateway)
    model = (("model", LLAMA8),)
    count = seen[("neuralgrid_inter_token_latency_seconds_count", model)]
    assert count == 11, count
    mean = seen[("neuralgrid_inter_token_latency_seconds_sum", model)] / count
    assert 0.015 <= mean <= 0.04, mean
    fast = seen[("neuralgrid_inter_token_latency_seconds_bucket", (("le", "0.005"), *model))]
    assert fast <= 1, fast  # at 20 ms a token, (nearly) no gap is under 5 ms


def test_fleet_gauges_follow_the_database(conn: psycopg.Connection, gateway: str) -> None:
    make_node(conn, "a", vram_gb=24, max_concurrency=4, inflight=1)
    make_node(conn, "b", vram_gb=80, max_concurrency=8, status="busy", inflight=8)
    make_node(conn, "c", vram_gb=48, status="offline")
    cooling = make_node(conn, "d", vram_gb=16, max_concurrency=2)
    conn.execute("update nodes set cooldown_until = now() + interval '1 minute' where id = %s", (cooling,))
    seen = scrape(gateway)
    gauge = {
        labels[0][1]: value for (name, labels), value in seen.items() if name == "neuralgrid_fleet_nodes"
    }
    assert gauge == {"online": 2, "busy": 1, "draining": 0, "offline": 1}
    assert seen[("neuralgrid_fleet_vram_gb", (("status", "online"),))] == 40
    assert seen[("neuralgrid_fleet_vram_gb", (("status", "busy"),))] == 80
    assert seen[("neuralgrid_fleet_slots", (("state", "free"),))] == 3  # a's three; d cools down
    assert seen[("neuralgrid_fleet_slots", (("state", "busy"),))] == 9
    conn.execute("delete from nodes where id = %s", (cooling,))
    assert scrape(gateway)[("neuralgrid_fleet_nodes", (("status", "online"),))] == 1


def test_the_model_label_holds_only_models_a_node_served(fake_nodes: Any, gateway: str, api_key: str) -> None:
    fake_nodes()
    auth = {"authorization": f"Bearer {api_key}"}
    for _ in range(20):
        body = {"model": f"scan/{uuid.uuid4()}", "messages": MESSAGES}
        assert httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=auth).status_code == 404
    labelled = {dict(labels).get("model") for (_, labels) in scrape(gateway)}
    assert not [m for m in labelled if m and m.startswith("scan/")]


def test_the_grafana_dashboard_reads_only_metrics_the_gateway_serves(
    fake_nodes: Any, gateway: str, api_key: str
) -> None:
    """docs/grafana/neuralgrid-gateway.json stays true: every series it queries is on /metrics."""
    fake_nodes()
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=0) as sdk:
        list(sdk.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=3, stream=True))
    written_behind(gateway)  # a leased job's end is counted once written, with its cost
    served = {name for name, _ in scrape(gateway)}
    dashboard = json.loads((Path(__file__).parents[2] / "docs/grafana/neuralgrid-gateway.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(neuralgrid_[a-z_]+)", target["expr"])
    }
    assert len(queried) >= 12 and queried <= served, sorted(queried - served)
