"""Prometheus metrics, in a registry per app (no process-wide state for tests to reset)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from neuralgrid.db.queries import JobOutcome

FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
            "match_job() round trip.",
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
        self.attempts = Counter(
            "neuralgrid_attempts_total", "Attempts by outcome.", ["outcome"], registry=self.registry
        )
        self.failovers = Counter(
            "neuralgrid_failovers_total", "Moves to a fallback node.", registry=self.registry
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

    def count(self, node_id: object, outcome: JobOutcome) -> None:
        """One attempt's outcome, overall and for its node."""
        self.attempts.labels(outcome).inc()
        self.node_outcomes.labels(str(node_id), outcome).inc()
