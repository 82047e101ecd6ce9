"""``GET /metrics``: the server's counters in Prometheus' text format (prometheus_client,
one registry per server, so that several servers in one process count apart)."""

from __future__ import annotations

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
except ImportError as e:  # pragma: no cover - exercised by the missing-extra test
    from phaseloop.serve.web import missing_extra

    missing_extra(e)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("phaseloop_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("phaseloop_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("phaseloop_generation_tokens", "tokens generated", registry=r)
        self.queue = Gauge("phaseloop_queue_length", "sequences waiting for a place in the batch", registry=r)
        self.running = Gauge("phaseloop_running_sequences", "sequences in the batch being decoded", registry=r)
        self.latency = Histogram("phaseloop_request_latency_seconds", "time from a request's arrival to its "
                                 "last byte, by route", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("phaseloop_batch_rows", "rows per decode step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128))

    def text(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
