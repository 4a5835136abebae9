"""OpenAI-compatible HTTP server (``spechead serve``, options in ``spechead.cli.serve``).

Exposes ``/v1/chat/completions`` and ``/v1/completions`` (JSON or server-sent events), ``/v1/models``,
``/health`` and a Prometheus ``/metrics``, so existing OpenAI clients work unchanged. Bottom to top:
``schema`` (request validation, OpenAI-format errors), ``stream`` (text deltas and stop strings),
``metrics``, ``worker`` (the bounded queue and the one decoding thread: decoding is batch 1) and ``app``
(the FastAPI routes and SSE framing). Every request has a wall-clock limit counted from its arrival, and a
client that goes away is dropped from the queue or stopped after the current verification round.
"""
