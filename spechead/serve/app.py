"""The HTTP side of ``spechead serve``: the FastAPI app, its routes and the SSE framing, on asyncio (uvicorn).

A handler validates the request (``schema``), admits it to the ``DecodeWorker``'s queue and relays the
worker's text deltas as one JSON answer or as server-sent events, watching the connection meanwhile so
that a client that leaves frees its place. No ``from __future__ import annotations`` here: FastAPI reads
the route parameters' annotations at runtime.
"""

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.model.loading import target_label
from spechead.serve.metrics import Metrics
from spechead.serve.schema import (
    MAX_BODY_BYTES,
    ApiError,
    Params,
    check_body,
    is_int,
    parse_messages,
    parse_params,
)
from spechead.serve.worker import DecodeWorker, Job, Outcome

log = logging.getLogger("spechead.serve")


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
        "head_stats": {k: v if math.isfinite(v) else None for k, v in o.head_stats.items()},  # JSON has no NaN
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


def create_app(worker: DecodeWorker):
    """The FastAPI application around a ``DecodeWorker``: its error handlers, completion routes and info routes."""
    from fastapi import FastAPI

    app = FastAPI(title="spechead", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app, worker.metrics)
    _add_completion_routes(app, worker)
    _add_info_routes(app, worker)
    return app


def _add_error_handlers(app, m: Metrics) -> None:
    """Answer every error in the OpenAI error shape; API and HTTP errors count in ``m`` under their status."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

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


def _add_completion_routes(app, worker: DecodeWorker) -> None:
    """``/v1/chat/completions`` and ``/v1/completions``: each validates its body and prompt, then answers."""
    from fastapi import Request

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_body(request, worker)
        turns = parse_messages(body)
        p = parse_params(body, worker.max_tokens, worker.default_head)  # validate everything before tokenizing
        try:
            ids = worker.encode_chat(turns)
        except SpecheadError as e:
            raise ApiError(400, str(e), "messages") from e
        worker.check_prompt(ids, "messages")
        p.prompt_ids = ids
        return await _answer(request, worker, p, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read_body(request, worker)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        p = parse_params(body, worker.max_tokens, worker.default_head)
        if isinstance(prompt, str):
            ids = worker.encode_text(prompt) if prompt else []
        elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        worker.check_prompt(ids, "prompt")
        p.prompt_ids = ids
        return await _answer(request, worker, p, chat=False)


async def _read_body(request, worker: DecodeWorker) -> dict:
    """The request's JSON body, checked against ``schema``; a body over ``MAX_BODY_BYTES`` is a 413."""
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
    return check_body(body, worker.model_name)


async def _answer(request, worker: DecodeWorker, p: Params, chat: bool):
    """Submit the request's job and answer it: one JSON body, or server-sent events when ``p.stream``."""
    from fastapi.responses import StreamingResponse

    await asyncio.to_thread(worker.check_head, p.head)  # a 400 before any response starts, streamed or not
    job = Job(p, asyncio.get_running_loop(), worker.timeout)
    worker.submit(job)
    # Watch the connection from now on: a client that leaves while its job waits (or before a
    # stream's first byte) must free its place too. Handlers stop the watcher once they finish.
    watcher = asyncio.create_task(_watch_disconnect(request, lambda: worker.cancel(job)))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    obj = "chat.completion" if chat else "text_completion"
    base = {
        "id": rid,
        "object": obj + (".chunk" if chat and p.stream else ""),
        "created": int(time.time()),
        "model": worker.model_name,
    }
    path = request.url.path
    if not p.stream:
        return await _json_answer(worker, job, watcher, base, path, chat)
    worker.metrics.requests.labels(path, "200").inc()
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _event_stream(worker, job, watcher, base, chat)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _json_answer(
    worker: DecodeWorker, job: Job, watcher: asyncio.Task, base: dict[str, Any], path: str, chat: bool
):
    """The non-streamed answer: the job's text deltas joined into one JSON body once it finishes.

    An error (504 on timeout) is raised for the error handler; a job that times out or whose handler is
    cancelled leaves the worker.
    """
    from fastapi.responses import JSONResponse

    m = worker.metrics
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
            worker.cancel(job, disconnected=False)
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
    return JSONResponse({**base, "choices": [ch], "usage": _usage(out), "spechead": _extra(out, job.params.head)})


def _choice(chat: bool, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk's choice: a chat delta (the first one names the role) or a completion's text."""
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


async def _event_stream(
    worker: DecodeWorker, job: Job, watcher: asyncio.Task, base: dict[str, Any], chat: bool
) -> AsyncIterator[bytes]:
    """The streamed answer as SSE frames: text chunks, the finish (and usage if asked for), then ``[DONE]``.

    Headers are sent already, so an error travels as an event; a job that times out or whose client
    disconnects leaves the worker.
    """
    m = worker.metrics
    p = job.params
    finished = timed_out = False
    try:
        if chat:
            yield _sse({**base, "choices": [_choice(chat, None, None, first=True)]})
        while True:
            kind, payload = await _next_event(job)
            if kind == "text":
                yield _sse({**base, "choices": [_choice(chat, payload, None)]})
                continue
            timed_out = kind == "error" and payload.status == 504
            finished = not timed_out
            if kind == "error":
                if timed_out:
                    m.timeouts.inc()
                yield _sse(payload.body())  # headers are gone: errors travel as an event
            else:
                yield _sse({**base, "choices": [_choice(chat, None, payload.finish_reason)]})
                if p.include_usage:
                    extra = {"usage": _usage(payload), "spechead": _extra(payload, p.head)}
                    yield _sse({**base, "choices": [], **extra})
            break
        yield b"data: [DONE]\n\n"
    finally:  # also runs when the client disconnects (starlette cancels the response task)
        watcher.cancel()
        if not finished:
            worker.cancel(job, disconnected=not timed_out)


def _model_card(worker: DecodeWorker) -> dict[str, Any]:
    """The served model in the OpenAI model-object shape, with its context length."""
    return {
        "id": worker.model_name,
        "object": "model",
        "created": worker.created,
        "owned_by": "spechead",
        "max_model_len": worker.session.max_len,
    }


def _add_info_routes(app, worker: DecodeWorker) -> None:
    """``/v1/models`` (and one model by id), ``/health`` (503 once the worker is down) and ``/metrics``."""
    from fastapi.responses import JSONResponse, Response

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(worker)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != worker.model_name:
            raise ApiError(404, f"model {model_id!r} not found", "model", "model_not_found")
        return _model_card(worker)

    @app.get("/health")
    async def health():
        body = {
            "status": "ok" if worker.alive else "down",
            "model": worker.model_name,
            "waiting": worker.waiting,
            "busy": worker.busy,
        }
        return JSONResponse(body, status_code=200 if worker.alive else 503)

    @app.get("/metrics")
    async def metrics():
        data, ctype = worker.metrics.render()
        return Response(data, media_type=ctype)


def build_worker(args) -> DecodeWorker:
    """The worker for ``spechead serve``'s options: target, drafter, default head and tree, queue and limits."""

    from spechead.decoding.session import check_drafter_spec, resolve_drafter
    from spechead.heads.base import check_head_spec
    from spechead.tuning.tune import open_session

    # bad options fail here, before the target loads and the default head's tree is tuned
    tree = args.tree if args.tree is None or args.tree.strip() == "auto" else TreeConfig.parse(args.tree)
    max_batch = getattr(args, "max_batch", 1)
    DecodeWorker.check_limits(args.queue_size, args.timeout, args.max_tokens, max_batch)
    check_head_spec(args.head)
    check_drafter_spec(args.drafter)
    session = open_session(args.target, args.max_len, args.dtype)
    drafter = resolve_drafter(args.drafter, session.target, args.arch)
    name = args.served_model_name or target_label(args.target)
    return DecodeWorker(
        session, drafter, args.head, tree, args.queue_size, args.timeout, args.max_tokens, name, max_batch
    )
