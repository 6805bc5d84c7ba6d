"""Prometheus metrics, in a registry per app (no process-wide state for tests to reset)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from neuralgrid.db.queries import JobOutcome
from neuralgrid.protocol.sse import Usage

FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# vLLM's buckets for the same two measures, so that dashboards read alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# vLLM's inter-token buckets, with three below 10 ms for small models on fast GPUs.
ITL_BUCKETS = (0.001, 0.0025, 0.005, *TPOT_BUCKETS, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
NODE_STATUSES = ("online", "busy", "draining", "offline")
# Nodes named in per-node series; the rest share node="other", so a fleet of 100,000 cannot blow up a
# scrape (per-node history of every node is in SQL: nodes.successes, failures, node_status_history).
MAX_NODE_SERIES = 256

M = TypeVar("M", bound=MetricWrapperBase)


class Metrics:
    def __init__(self, max_node_series: int = MAX_NODE_SERIES) -> None:
        self.registry = CollectorRegistry()
        self.max_node_series = max_node_series
        self._named_nodes: set[str] = set()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "neuralgrid_requests_total",
            "Requests by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "neuralgrid_request_seconds",
            "Time to the response headers.",
            ["endpoint"],
            registry=self.registry,
        )
        self.overhead = Histogram(
            "neuralgrid_overhead_seconds",
            "Time spent in the gateway, not the node.",
            buckets=FAST_BUCKETS,
            registry=self.registry,
        )
        self.matcher = Histogram(
            "neuralgrid_matcher_seconds",
            "Placing a request: its place_jobs() group's round trip, and the wait for the group before it.",
            buckets=FAST_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "neuralgrid_queue_wait_seconds",
            "Time a request waited for a free slot (0 when one was free).",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=self.registry,
        )
        self.queue_refused = Counter(
            "neuralgrid_queue_refused_total",
            "Requests refused while every capable node was busy: the line was full, or the deadline passed.",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("full", "deadline"):  # at 0 from the start: a dashboard's rate() needs the series
            self.queue_refused.labels(reason)
        self.attempts = Counter(
            "neuralgrid_attempts_total", "Attempts by outcome.", ["outcome"], registry=self.registry
        )
        self.failovers = Counter(
            "neuralgrid_failovers_total", "Moves to a fallback node.", registry=self.registry
        )
        self.journal_pending = Gauge(
            "neuralgrid_journal_pending",
            "Records of jobs served from leases not yet written to Postgres (written behind).",
            registry=self.registry,
        )
        self.leased = Counter(
            "neuralgrid_leased_placements_total",
            "Requests placed on a slot this gateway leases, with no round trip to Postgres.",
            registry=self.registry,
        )
        self.resumes = Counter(
            "neuralgrid_stream_resumes_total",
            "Streams a node dropped after their first byte, resumed on another node.",
            registry=self.registry,
        )
        self.node_outcomes = Counter(
            "neuralgrid_node_outcomes_total",
            "Attempt outcomes per node.",
            ["node", "outcome"],
            registry=self.registry,
        )

        # Per model: only models some node served (a job was placed), so the label stays bounded.
        self.jobs = Counter(
            "neuralgrid_jobs_total",
            "Jobs ended, by model and outcome.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "neuralgrid_tokens_total",
            "Tokens of ended jobs, by model and type (prompt or completion).",
            ["model", "type"],
            registry=self.registry,
        )
        self.cost = Counter(
            "neuralgrid_cost_usd_total",
            "What ended jobs cost their keys, by model.",
            ["model"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "neuralgrid_time_to_first_token_seconds",
            "Streams: from asking the node to its first event.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "neuralgrid_time_per_output_token_seconds",
            "Streams: time per token after the first (a stream's average).",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "neuralgrid_inter_token_latency_seconds",
            "Streams: the time between one token event and the next, as relayed to the client (events"
            " arriving together share the wait before them).",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        # The fleet as the database has it, read when /metrics is scraped (see fleet()).
        self.fleet_nodes = Gauge(
            "neuralgrid_fleet_nodes", "Nodes by status.", ["status"], registry=self.registry
        )
        self.fleet_vram = Gauge(
            "neuralgrid_fleet_vram_gb", "VRAM of the nodes, by status.", ["status"], registry=self.registry
        )
        self.fleet_slots = Gauge(
            "neuralgrid_fleet_slots",
            "Request slots of online nodes: free (claimable now) or busy.",
            ["state"],
            registry=self.registry,
        )

        # Model verification (gateway/verifier.py): this gateway's challenges, and every (node, model)
        # under verification by state, as the database has it when scraped (see checks()).
        self.challenges = Counter(
            "neuralgrid_challenges",
            "Challenges this gateway sent, by verdict: passed, failed, inconclusive (the node failed"
            " as a node, or the referee did not score) or deferred (the node had no free slot).",
            ["verdict"],
            registry=self.registry,
        )
        self.referee_cpu = Histogram(
            "neuralgrid_referee_cpu_seconds",
            "The referee's CPU time to score one challenge or audit (all its threads).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
            registry=self.registry,
        )
        self.gpu_probes = Counter(
            "neuralgrid_gpu_probes",
            "GPU probes this gateway made, by outcome: passed, slow, wrong, no_gpu, refused or"
            " unreachable (gateway/gpu_prober.py).",
            ["outcome"],
            registry=self.registry,
        )
        self.model_checks = Gauge(
            "neuralgrid_model_checks",
            "(node, model)s under verification, by state: unverified, verified, suspect, failed.",
            ["state"],
            registry=self.registry,
        )

    def child(self, metric: M, *labels: str) -> M:
        """metric.labels(*labels), looked up once per label set: labels() takes microseconds a call,
        and a request names up to ten. Every label set is bounded (templated routes, models nodes
        serve, MAX_NODE_SERIES nodes), and none is ever removed."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def ended(
        self,
        model: str,
        outcome: JobOutcome,
        usage: Usage,
        cost_usd: float | None,
        timings: tuple[float, float] | None,
    ) -> None:
        """One job's end, for its model: outcome, tokens, cost and (streams) latency per token."""
        self.child(self.jobs, model, outcome).inc()
        self.child(self.tokens, model, "prompt").inc(usage.prompt_tokens)
        self.child(self.tokens, model, "completion").inc(usage.completion_tokens)
        if cost_usd:
            self.child(self.cost, model).inc(cost_usd)
        if timings is not None:
            self.child(self.ttft, model).observe(timings[0])
            self.child(self.tpot, model).observe(timings[1])

    def fleet(self, rows: list[Mapping[str, Any]]) -> None:
        """The fleet gauges from FLEET_GAUGES's rows (one per node status)."""
        by_status = {row["status"]: row for row in rows}
        for status in NODE_STATUSES:
            row = by_status.get(status, {})
            self.fleet_nodes.labels(status).set(row.get("nodes", 0))
            self.fleet_vram.labels(status).set(row.get("vram_gb", 0.0))
        self.fleet_slots.labels("free").set(sum(row["free_slots"] for row in rows))
        self.fleet_slots.labels("busy").set(sum(row["busy_slots"] for row in rows))

    def checks(self, rows: list[Any]) -> None:
        """The verification gauge from CHECK_STATES's rows (one per state)."""
        for row in rows:
            self.model_checks.labels(row.state).set(row.count)

    def count(self, node_id: object, outcome: JobOutcome) -> None:
        """One attempt's outcome, overall and for its node (the first max_node_series nodes by
        name, the others as "other")."""
        self.child(self.attempts, outcome).inc()
        node = str(node_id)
        if node not in self._named_nodes:
            if len(self._named_nodes) >= self.max_node_series:
                node = "other"
            else:
                self._named_nodes.add(node)
        self.child(self.node_outcomes, node, outcome).inc()
