"""The server's Prometheus metrics (``GET /metrics``): request counts, tokens, tau and queue depth."""

from __future__ import annotations


class Metrics:
    """Prometheus metrics in a registry of their own (several servers can live in one process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

        r = self.registry = CollectorRegistry()
        self.requests = Counter("spechead_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.cancelled = Counter("spechead_requests_cancelled", "Requests dropped: client went away", registry=r)
        self.timeouts = Counter("spechead_requests_timed_out", "Requests over the time limit", registry=r)
        self.prompt_tokens = Counter("spechead_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("spechead_generation_tokens", "Tokens generated", registry=r)
        # prefill is what batching cannot share: under a prompt-heavy load its share bounds what batching gains
        self.prefill_seconds = Counter("spechead_prefill_seconds", "Wall time spent prefilling prompts", registry=r)
        self.tokens_per_s = Gauge("spechead_tokens_per_second", "Decode rate of the last request", registry=r)
        self.tau = Gauge("spechead_tau", "Tokens per target forward, last request", ["head"], registry=r)
        self.tau_summary = Summary("spechead_request_tau", "Tokens per target forward per request", registry=r)
        self.active_vocab = Gauge(
            "spechead_active_vocab_size", "Draft head's active vocabulary, last request", ["head"], registry=r
        )
        self.waiting = Gauge("spechead_queue_waiting", "Requests waiting for the decoder", registry=r)
        self.busy = Gauge("spechead_busy", "1 while a request is decoding", registry=r)
        self.batch_occupancy = Gauge("spechead_batch_occupancy", "Requests in the last batched round", registry=r)
        self.batch_rounds = Counter("spechead_batch_rounds", "Batched rounds run", registry=r)
        self.batch_request_rounds = Counter(
            "spechead_batch_request_rounds", "Requests summed over batched rounds", registry=r
        )
        self.request_tokens_per_s = Summary(
            "spechead_request_tokens_per_second", "Output tokens per second of decoding, per request", registry=r
        )
        self.latency = Histogram(
            "spechead_request_seconds",
            "Arrival to last token",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.queue_wait = Histogram(
            "spechead_queue_wait_seconds",
            "Arrival to start of decoding",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
