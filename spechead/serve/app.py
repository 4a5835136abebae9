"""OpenAI-compatible HTTP server: ``spechead serve``.

Exposes ``/v1/chat/completions`` and ``/v1/completions`` (JSON or server-sent events), ``/v1/models``,
``/health`` and a Prometheus ``/metrics``, so existing OpenAI clients work unchanged.

Decoding is batch 1, so one worker thread runs one request at a time and the rest wait in a bounded
FIFO queue: a full queue answers 503 with a Retry-After estimate instead of piling up latency, a
client that goes away (streaming or not) is dropped from the queue or stopped after the current
verification round, and every request has a wall-clock limit counted from its arrival. The HTTP
side is asyncio (uvicorn); the worker hands text deltas to it through a per-request asyncio queue.
Stop strings are applied on text, not tokens: the worker holds back any tail that could still become
a stop string (or an unfinished UTF-8 character) and ends generation as soon as one appears.
"""

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from spechead.decoding.decoder import Decoder, GenerationResult
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.session import AUTO_TREE
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.model.loading import DEMO_NAME
from spechead.tuning.tune import AUTO_TREE_HELP, cached

log = logging.getLogger("spechead.serve")

MAX_BODY_BYTES = 16 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_CACHED_DECODERS = 4


# -- errors ---------------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or {
            400: "invalid_request_error",
            404: "invalid_request_error",
            413: "invalid_request_error",
            499: "cancelled",
            503: "server_overloaded",
            504: "timeout_error",
        }.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- request parsing --------------------------------------------------------------------------------
@dataclass
class Params:
    """A validated generation request."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: list[str]
    head: str
    stream: bool
    include_usage: bool


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _get(body: dict, name: str, check: Callable[[Any], bool], what: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:60]}", name)
    return value


def _in_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:  # also rejects NaN
        bracket = "(" if lo_open else "["
        raise ApiError(400, f"'{name}' must be in {bracket}{lo}, {hi}], got {value}", name)


# Options we do not implement: refuse non-default values rather than silently ignoring them.
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
    "suffix": None,
}


def _check_unsupported(body: dict) -> None:
    for name, default in UNSUPPORTED.items():
        value = body.get(name)
        if value is None or value == default or (not value and default in (None, False)):
            continue
        raise ApiError(400, f"'{name}' = {json.dumps(value)[:60]} is not supported by this server", name)


def parse_sampling(body: dict, default_max_tokens: int) -> tuple[int, SamplingConfig, list[str]]:
    """max_tokens, the sampling config and the stop strings; OpenAI's defaults (temperature 1)."""
    temperature = float(_get(body, "temperature", _is_number, "a number", 1.0))
    _in_range("temperature", temperature, 0.0, 2.0)
    top_p = float(_get(body, "top_p", _is_number, "a number", 1.0))
    _in_range("top_p", top_p, 0.0, 1.0, lo_open=True)
    top_k = _get(body, "top_k", _is_int, "an integer", 0)
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    if top_k < 0:
        raise ApiError(400, f"'top_k' must be >= 0 (or -1 for off), got {top_k}", "top_k")
    seed = _get(body, "seed", _is_int, "an integer")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, _is_int, "an integer", default_max_tokens)
    if max_tokens < 1:
        raise ApiError(400, f"'{name}' must be >= 1, got {max_tokens}", name)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings of up to {MAX_STOP_CHARS} characters", "stop")
    seed = None if seed is None else seed % 2**63
    return max_tokens, SamplingConfig(temperature, top_p, top_k, seed), stop


def parse_head(body: dict, default: str) -> str:
    """The draft head: top-level ``head`` or ``spechead: {"head": ...}`` (extra_body in the openai client)."""
    extra = body.get("spechead")
    if extra is not None and not isinstance(extra, dict):
        raise ApiError(400, "'spechead' must be an object", "spechead")
    head = body.get("head", (extra or {}).get("head"))
    if head is None:
        return default
    if not isinstance(head, str) or not head:
        raise ApiError(400, "'head' must be a non-empty string such as \"full\"", "head")
    from spechead.heads import base as heads

    if head.partition(":")[0] not in heads.HEADS:
        raise ApiError(400, f"unknown head {head!r}; available: {', '.join(sorted(heads.HEADS))}", "head")
    return head


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        turns.append({"role": m["role"], "content": content})
    return turns


# -- text deltas and stop strings -----------------------------------------------------------------
class TextStream:
    """Turns a growing token list into text deltas and finds the first stop string.

    The text of all tokens so far is decoded each round (cheap next to a forward pass) and only its
    settled part is released: a tail that is a prefix of some stop string, or an unfinished UTF-8
    character (decoded as U+FFFD), is held back until the next tokens decide it. The concatenated
    deltas therefore equal the final (stop-cut) text, streamed or not.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode, self.stop = decode, stop
        self.sent = 0
        self.stopped = False

    def _cut(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return max(min(hits), self.sent) if hits else None

    def push(self, tokens: list[int]) -> str:
        """The new settled text after ``tokens``; sets ``stopped`` when a stop string appeared."""
        text = self.decode(tokens)
        cut = self._cut(text)
        if cut is not None:
            self.stopped = True
            return self._release(text, cut)
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        room = end - self.sent
        hold = max(
            (k for s in self.stop for k in range(1, min(len(s) - 1, room) + 1) if s.startswith(text[end - k : end])),
            default=0,
        )  # the longest tail that could still grow into a stop string
        return self._release(text, end - hold)

    def finish(self, tokens: list[int]) -> str:
        """Whatever is left once generation has ended (the stop cut still applies)."""
        if self.stopped:
            return ""
        text = self.decode(tokens)
        cut = self._cut(text)
        self.stopped = cut is not None
        return self._release(text, len(text) if cut is None else cut)

    def _release(self, text: str, end: int) -> str:
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


# -- metrics --------------------------------------------------------------------------------------
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
        self.tokens_per_s = Gauge("spechead_tokens_per_second", "Decode rate of the last request", registry=r)
        self.tau = Gauge("spechead_tau", "Tokens per target forward, last request", ["head"], registry=r)
        self.tau_summary = Summary("spechead_request_tau", "Tokens per target forward per request", registry=r)
        self.active_vocab = Gauge(
            "spechead_active_vocab_size", "Draft head's active vocabulary, last request", ["head"], registry=r
        )
        self.waiting = Gauge("spechead_queue_waiting", "Requests waiting for the decoder", registry=r)
        self.busy = Gauge("spechead_busy", "1 while a request is decoding", registry=r)
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
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# -- the decoding worker --------------------------------------------------------------------------
@dataclass
class Outcome:
    seq: int  # the order in which the decoder took requests up (FIFO: the arrival order)
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    tau: float
    decode_s: float
    head_stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Job:
    """One admitted request; the worker talks to its HTTP handler through ``events``."""

    params: Params
    loop: asyncio.AbstractEventLoop
    timeout: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.monotonic)
    seq: int = -1
    done: bool = False

    @property
    def deadline(self) -> float:
        return self.arrival + self.timeout

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


class Engine:
    """Owns the target, drafter and per-head decoders, the bounded queue and the worker thread."""

    def __init__(
        self,
        session,
        drafter,
        head: str = "full",
        tree: TreeConfig | str | None = None,
        queue_size: int = 16,
        timeout: float = 300.0,
        max_tokens: int = 512,
        model_name: str = DEMO_NAME,
    ) -> None:
        if queue_size < 0 or timeout <= 0 or max_tokens < 1:
            raise SpecheadError("need --queue-size >= 0, --timeout > 0 and --max-tokens >= 1")
        self.session, self.drafter, self.tree = session, drafter, tree
        self.default_head, self.queue_size, self.timeout = head, queue_size, timeout
        self.max_tokens, self.model_name, self.created = max_tokens, model_name, int(time.time())
        self.metrics = Metrics()
        self._tok_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        self._decoders: OrderedDict[str, Decoder] = OrderedDict()
        self._default_tree: TreeConfig | None = None  # the default head's: other heads' tree when not tuned
        self._decoder(head)  # a bad --head fails at startup, not on the first request
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._taken = 0  # requests the worker has taken up, for Outcome.seq
        self._closed = False
        self._service_s = 1.0  # moving average of decode time, for Retry-After
        self._thread = threading.Thread(target=self._work, name="spechead-decoder", daemon=True)
        self._thread.start()

    # -- tokenizer ------------------------------------------------------------------------------
    def encode_chat(self, turns: list[dict[str, str]]) -> list[int]:
        with self._tok_lock:
            try:
                return self.session.encode(turns)
            except SpecheadError:
                raise
            except Exception as e:  # chat templates raise their own errors (e.g. bad role order)
                raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from e

    def encode_text(self, text: str) -> list[int]:
        with self._tok_lock:
            return self.session.tokenizer(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.session.decode(ids)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        if len(ids) >= self.session.max_len:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this server's context is {self.session.max_len} tokens "
                "(prompt plus at least one generated token)",
                param,
                "context_length_exceeded",
            )
        vocab = self.session.target.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ApiError(400, f"token ids must be in [0, {vocab})", param)

    # -- queue ----------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, job: Job) -> None:
        """Admit a job at the back of the queue, or refuse with 503 when ``queue_size`` already wait."""
        with self._cv:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            in_flight = len(self._waiting) + (self._running is not None)
            if in_flight > self.queue_size:
                retry = max(1, math.ceil(self._service_s * in_flight))
                raise ApiError(
                    503,
                    f"server busy: {len(self._waiting)} requests already waiting; retry in {retry} s",
                    code="queue_full",
                    headers={"Retry-After": str(retry)},
                )
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify_all()

    def cancel(self, job: Job, disconnected: bool = True) -> None:
        """Drop a job: out of the queue at once, or stopped after the running round. Its handler
        gets a terminal event so that nothing waits for a job that will never finish."""
        with self._cv:
            if job.done or job.cancelled.is_set():
                return
            job.cancelled.set()
            if disconnected:
                self.metrics.cancelled.inc()
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.waiting.set(len(self._waiting))
        job.emit("error", ApiError(499, "request cancelled"))

    def close(self, wait: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            for job in self._waiting:
                job.cancelled.set()
                job.emit("error", ApiError(503, "the server is shutting down", code="shutting_down"))
            self._waiting.clear()
            if self._running is not None:
                self._running.cancelled.set()
            self._cv.notify_all()
        self._thread.join(wait)

    def _next(self) -> Job | None:
        with self._cv:
            while not self._waiting and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            self._running = job = self._waiting.popleft()
            job.seq, self._taken = self._taken, self._taken + 1
            self.metrics.waiting.set(len(self._waiting))
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            t0 = time.monotonic()
            self.metrics.busy.set(1)
            try:
                self._run(job)
            except ApiError as e:
                job.emit("error", e)
            except SpecheadError as e:
                job.emit("error", ApiError(400, str(e)))
            except Exception as e:  # never let one request take the worker down
                log.exception("request failed")
                job.emit("error", ApiError(500, f"internal error: {type(e).__name__}: {e}"))
            finally:
                self.metrics.busy.set(0)
                with self._cv:
                    job.done = True
                    self._running = None
                    self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - t0)

    # -- decoding -------------------------------------------------------------------------------
    def _decoder(self, head: str) -> Decoder:
        """Decoders per head spec, least recently used dropped; all share the target and its KV cache,
        which is safe because only the worker thread decodes, one request at a time."""
        if head in self._decoders:
            self._decoders.move_to_end(head)
            return self._decoders[head]
        tree = self.tree
        if tree == AUTO_TREE and self._default_tree is not None:  # not the default head (tuned at startup):
            tuned = cached(self.session, self.drafter, head)  # its tuning if cached, else the default head's tree
            tree = AUTO_TREE if tuned is not None else self._default_tree
        dec = self.session.decoder(self.drafter, head, tree)
        if self._default_tree is None:
            self._default_tree = dec.tree
        self._decoders[head] = dec
        while len(self._decoders) > MAX_CACHED_DECODERS:
            self._decoders.popitem(last=False)
        return dec

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        p, m = job.params, self.metrics
        m.queue_wait.observe(time.monotonic() - job.arrival)
        try:
            dec = self._decoder(p.head)
        except Exception as e:  # the head spec is user input: a bad argument is the request's fault
            raise ApiError(400, f"cannot build draft head {p.head!r}: {type(e).__name__}: {e}", "head") from e
        text = TextStream(self.decode, p.stop)
        tokens: list[int] = []
        rounds: list[int] = []
        result: GenerationResult | None = None
        t0 = time.perf_counter()
        gen = dec.stream(p.prompt_ids, p.max_tokens, p.sampling, speculative=True)
        try:
            for item in gen:
                if isinstance(item, GenerationResult):
                    result = item
                    break
                tokens += item
                rounds.append(len(item))
                piece = text.push(tokens)
                if piece:
                    job.emit("text", piece)
                if text.stopped or job.cancelled.is_set():
                    break
        finally:
            gen.close()  # frees the decoder at once when we stop early
        decode_s = time.perf_counter() - t0
        m.prompt_tokens.inc(len(p.prompt_ids))
        m.generation_tokens.inc(len(tokens))  # work done, even for a request cancelled half-way
        if job.cancelled.is_set():
            return
        piece = text.finish(tokens)
        if piece:
            job.emit("text", piece)
        if result is not None:
            tau, stats = result.tau, result.head_stats
        else:  # stopped early: the first chunk is the prefill token, each later one a verification round
            tau, stats = (sum(rounds[1:]) / len(rounds[1:]) if len(rounds) > 1 else 1.0), dec.head.stats()
        finish = "stop" if text.stopped or (result and result.stop_reason == "stop_token") else "length"
        out = Outcome(job.seq, finish, len(p.prompt_ids), len(tokens), tau, decode_s, dict(stats))
        m.tokens_per_s.set(out.completion_tokens / max(decode_s, 1e-9))
        m.tau.labels(p.head).set(tau)
        m.tau_summary.observe(tau)
        if "active_size" in stats:
            m.active_vocab.labels(p.head).set(stats["active_size"])
        m.latency.observe(time.monotonic() - job.arrival)
        job.emit("done", out)


# -- HTTP -----------------------------------------------------------------------------------------
def _error_response(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _usage(o: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "tau": round(o.tau, 4),
    }


def _extra(o: Outcome, head: str) -> dict[str, Any]:
    return {
        "head": head,
        "seq": o.seq,
        "tau": round(o.tau, 4),
        "tokens_per_s": round(o.completion_tokens / max(o.decode_s, 1e-9), 2),
        "head_stats": o.head_stats,
    }


async def _next_event(job: Job) -> tuple[str, Any]:
    """The worker's next event, or a timeout error once the request's time limit has passed."""
    remaining = job.deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        return await asyncio.wait_for(job.events.get(), remaining)
    except TimeoutError:
        return "error", ApiError(504, f"the request exceeded the server's time limit of {job.timeout:g} s")


async def _watch_disconnect(request, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    on_gone()


def create_app(engine: Engine):
    """The FastAPI application around an ``Engine``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="spechead", docs_url=None, redoc_url=None, openapi_url=None)
    m = engine.metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        m.requests.labels(request.url.path, str(e.status)).inc()
        return _error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        m.requests.labels("other", str(e.status_code)).inc()
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error_response(ApiError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(ApiError(400, str(e)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return _error_response(ApiError(500, f"internal error: {type(e).__name__}"))

    async def read_body(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if model != engine.model_name:
            raise ApiError(
                404, f"model {model!r} not found; this server serves {engine.model_name!r}", "model", "model_not_found"
            )
        _check_unsupported(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise ApiError(400, "'stream_options' must be {\"include_usage\": bool}", "stream_options")
        return body

    def params(body: dict, prompt_ids: list[int]) -> Params:
        max_tokens, sampling, stop = parse_sampling(body, engine.max_tokens)
        head = parse_head(body, engine.default_head)
        opts = body.get("stream_options") or {}
        return Params(
            prompt_ids,
            max_tokens,
            sampling,
            stop,
            head,
            body.get("stream", False),
            bool(opts.get("include_usage", False)),
        )

    async def respond(request: Request, p: Params, chat: bool):
        job = Job(p, asyncio.get_running_loop(), engine.timeout)
        engine.submit(job)
        # Watch the connection from now on: a client that leaves while its job waits (or before a
        # stream's first byte) must free its place too. Handlers stop the watcher once they finish.
        watcher = asyncio.create_task(_watch_disconnect(request, lambda: engine.cancel(job)))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        base = {
            "id": rid,
            "object": obj + (".chunk" if chat and p.stream else ""),
            "created": int(time.time()),
            "model": engine.model_name,
        }
        path = request.url.path

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if not p.stream:
            pieces: list[str] = []
            finished = False
            try:
                while True:
                    kind, payload = await _next_event(job)
                    if kind == "text":
                        pieces.append(payload)
                        continue
                    finished = kind == "done" or payload.status != 504
                    if kind == "error":
                        if payload.status == 504:
                            m.timeouts.inc()
                        raise payload
                    break
            finally:
                watcher.cancel()
                if not finished:  # timed out, or this handler was cancelled
                    engine.cancel(job, disconnected=False)
            out: Outcome = payload
            text = "".join(pieces)
            ch = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                }
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
            )
            m.requests.labels(path, "200").inc()
            return JSONResponse({**base, "choices": [ch], "usage": _usage(out), "spechead": _extra(out, p.head)})

        async def events() -> AsyncIterator[bytes]:
            finished = timed_out = False
            try:
                if chat:
                    yield _sse({**base, "choices": [choice(None, None, first=True)]})
                while True:
                    kind, payload = await _next_event(job)
                    if kind == "text":
                        yield _sse({**base, "choices": [choice(payload, None)]})
                        continue
                    timed_out = kind == "error" and payload.status == 504
                    finished = not timed_out
                    if kind == "error":
                        if timed_out:
                            m.timeouts.inc()
                        yield _sse(payload.body())  # headers are gone: errors travel as an event
                    else:
                        yield _sse({**base, "choices": [choice(None, payload.finish_reason)]})
                        if p.include_usage:
                            extra = {"usage": _usage(payload), "spechead": _extra(payload, p.head)}
                            yield _sse({**base, "choices": [], **extra})
                    break
                yield b"data: [DONE]\n\n"
            finally:  # also runs when the client disconnects (starlette cancels the response task)
                watcher.cancel()
                if not finished:
                    engine.cancel(job, disconnected=not timed_out)

        m.requests.labels(path, "200").inc()
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        turns = parse_messages(body)
        p = params(body, [])  # validate everything before tokenizing
        try:
            ids = engine.encode_chat(turns)
        except SpecheadError as e:
            raise ApiError(400, str(e), "messages") from e
        engine.check_prompt(ids, "messages")
        p.prompt_ids = ids
        return await respond(request, p, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        p = params(body, [])
        if isinstance(prompt, str):
            ids = engine.encode_text(prompt) if prompt else []
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        engine.check_prompt(ids, "prompt")
        p.prompt_ids = ids
        return await respond(request, p, chat=False)

    def model_card() -> dict[str, Any]:
        return {
            "id": engine.model_name,
            "object": "model",
            "created": engine.created,
            "owned_by": "spechead",
            "max_model_len": engine.session.max_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.model_name:
            raise ApiError(404, f"model {model_id!r} not found", "model", "model_not_found")
        return model_card()

    @app.get("/health")
    async def health():
        body = {
            "status": "ok" if engine.alive else "down",
            "model": engine.model_name,
            "waiting": engine.waiting,
            "busy": engine.busy,
        }
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics():
        data, ctype = m.render()
        return Response(data, media_type=ctype)

    return app


# -- CLI ------------------------------------------------------------------------------------------
def build_engine(args) -> Engine:
    from pathlib import Path

    from spechead.decoding.session import Session, resolve_drafter

    # auto: each head's decoder gets the tuning for this machine + target + drafter + head (the default head's
    # at startup, measured then if not cached; another head's on the first request that picks it)
    tree = args.tree if args.tree is None or args.tree.strip() == "auto" else TreeConfig.parse(args.tree)
    session = Session.open(args.target, args.max_len)
    drafter = resolve_drafter(args.drafter, session.target, args.arch)
    name = args.served_model_name or (DEMO_NAME if args.target == "demo" else Path(args.target).stem)
    return Engine(session, drafter, args.head, tree, args.queue_size, args.timeout, args.max_tokens, name)


def cmd_serve(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = build_engine(args)
    print(
        f"[spechead] serving {engine.model_name} (drafter {args.drafter}, head {args.head}) on "
        f"http://{args.host}:{args.port}/v1  queue {args.queue_size}, time limit {args.timeout:g} s",
        flush=True,
    )
    config = uvicorn.Config(
        create_app(engine), host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    try:
        uvicorn.Server(config).run()
    finally:
        engine.close()
    return 0


def add_cli(subparsers) -> None:
    s = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, streaming, metrics)")
    s.add_argument("--target", default="demo", help="demo, a HF model folder or a .gguf file")
    s.add_argument("--drafter", default="demo", help="demo, random or a drafter folder")
    s.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"], help="drafter kind for demo/random")
    s.add_argument("--head", default="full", help="default draft head (a request may pick another)")
    s.add_argument("--tree", default="auto", help=AUTO_TREE_HELP)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--queue-size", type=int, default=16, help="requests that may wait while one decodes")
    s.add_argument("--timeout", type=float, default=300.0, help="per-request time limit in seconds, from arrival")
    s.add_argument("--max-tokens", type=int, default=512, help="max_tokens when a request gives none")
    s.add_argument("--max-len", type=int, default=4096, help="context limit (KV cache size)")
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: the target's name)")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)
