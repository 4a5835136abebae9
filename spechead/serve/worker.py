"""The one decoding thread and its bounded FIFO queue. Up to ``max_batch`` requests decode together in one
``Decoder`` (``--max-batch 1``: one at a time, the same worker): a request joins at the next round with a free
lane, until then it waits in the queue; a full queue is refused at once (503 with Retry-After) instead of piling
up latency. Its text streams as each round commits tokens, and a request that is cancelled, disconnects, times
out or meets a stop string leaves at the next round, which frees its lane for the next in line. The worker hands
text deltas to the request's asyncio handler through the loop, never blocking on it."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from spechead import options
from spechead.decoding.decoder import Decoder, Event, GenerationResult, tau_of
from spechead.decoding.session import AUTO_TREE, Session
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead
from spechead.model.drafter import Drafter
from spechead.model.loading import DEMO_NAME
from spechead.model.tokenizer import encode_text
from spechead.serve.metrics import Metrics
from spechead.serve.schema import ApiError, Params
from spechead.serve.stream import TextStream

log = logging.getLogger("spechead.serve")

MAX_CACHED_HEADS = 4  # stateless heads other than the default kept built, least recently used dropped


@dataclass
class Outcome:
    """What a finished request reports: the response's finish_reason, usage and spechead extras."""

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


@dataclass
class _Live:
    """A request in the decoder: its job, text stream and tokens so far."""

    job: Job
    text: TextStream
    started: float
    tokens: list[int] = field(default_factory=list)
    stopped_by_text: bool = False


class DecodeWorker:
    """Owns the decoder (target, drafter, default head and tree), the bounded queue and the worker thread."""

    def __init__(
        self,
        session: Session,
        drafter: Drafter,
        head: str = "full",
        tree: TreeConfig | str | None = None,
        queue_size: int = 16,
        timeout: float = 300.0,
        max_tokens: int = 512,
        model_name: str = DEMO_NAME,
        max_batch: int = 1,
    ) -> None:
        self.check_limits(queue_size, timeout, max_tokens, max_batch)
        self.session, self.drafter, self.tree, self.capacity = session, drafter, tree, max_batch
        self.default_head, self.queue_size, self.timeout = head, queue_size, timeout
        self.max_tokens, self.model_name, self.created = max_tokens, model_name, int(time.time())
        self.metrics = Metrics()
        self._tok_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        # a bad --head fails at startup, not on the first request
        self.decoder: Decoder = session.decoder(drafter, head, AUTO_TREE if tree is None else tree, max_batch=max_batch)
        self._heads: OrderedDict[str, DraftHead] = OrderedDict()
        self._heads_ok: set[str] = set()  # head specs check_head built once
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._live: dict[int, _Live] = {}
        self._taken = 0  # requests the worker has taken up, for Outcome.seq
        self._closed = False
        self._service_s = 1.0  # moving average of a request's time in the decoder, for Retry-After
        self._thread = threading.Thread(target=self._work, name="spechead-decoder", daemon=True)
        self._thread.start()

    @staticmethod
    def check_limits(queue_size: int, timeout: float, max_tokens: int, max_batch: int = 1) -> None:
        """The queue and per-request limits, checked before anything loads (``build_worker``) and here."""
        if queue_size < 0 or not timeout > 0 or max_tokens < 1:
            raise SpecheadError(
                "need --queue-size >= 0, --timeout > 0 and --max-tokens >= 1, "
                f"got {queue_size}, {timeout:g} and {max_tokens}"
            )
        options.max_batch(max_batch, "--max-batch")

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
            return encode_text(self.session.tokenizer, text)  # what `generate --raw` reads too

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
    def decoding(self) -> int:
        """Requests being decoded now (up to ``max_batch``)."""
        return len(self._live)

    @property
    def busy(self) -> bool:
        return self.decoding > 0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, job: Job) -> None:
        """Admit a job at the back of the queue, or refuse with 503 when ``queue_size`` already wait."""
        with self._cv:
            if self._closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            in_flight = len(self._waiting) + self.decoding
            if in_flight > self.queue_size + self.capacity - 1:
                retry = max(1, math.ceil(self._service_s * in_flight / self.capacity))
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
        """Drop a job: out of the queue at once, or stopped at the next round. Its handler gets a terminal event
        so that nothing waits for a job that will never finish."""
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
            for job in (*self._waiting, *(live.job for live in self._live.values())):
                job.cancelled.set()
                job.emit("error", ApiError(503, "the server is shutting down", code="shutting_down"))
            self._waiting.clear()
            self._cv.notify_all()
        self._thread.join(wait)

    # -- heads ----------------------------------------------------------------------------------
    def check_head(self, spec: str) -> None:
        """Build a request's head once, before its response starts (a streamed one could only report a bad
        argument as an event after a 200): the name and options are checked by ``parse_params``, but only
        the weights tell whether ``lowrank:R`` or ``fr:N`` fit this drafter. Each spec is built once; the
        worker thread builds its own. Runs in a helper thread (``asyncio.to_thread``)."""
        if spec == self.default_head or spec in self._heads_ok:
            return
        self.build_head(spec)
        self._heads_ok.add(spec)

    def build_head(self, spec: str) -> DraftHead:
        """A request's draft head; a spec that cannot be built on this drafter is the request's fault (400)."""
        try:
            return self.session.draft_head(self.drafter, spec)
        except Exception as e:  # the head spec is user input: a bad argument is the request's fault
            raise ApiError(400, f"cannot build draft head {spec!r}: {type(e).__name__}: {e}", "head") from e

    def _request_head(self, spec: str) -> DraftHead | None:
        """None: the decoder's default head; a stateless head is built once and shared, a stateful one per
        request (a request holds its own reference, so eviction never touches one in flight)."""
        if spec == self.default_head:
            return None
        if spec in self._heads:
            self._heads.move_to_end(spec)
            return self._heads[spec]
        head = self.build_head(spec)
        if not head.per_round:
            self._heads[spec] = head
            while len(self._heads) > MAX_CACHED_HEADS:
                self._heads.popitem(last=False)
        return head

    # -- the loop -------------------------------------------------------------------------------
    def _admit(self) -> list[Job]:
        """Wait for work; take waiting jobs up while lanes are free. Returns them (empty: nothing new)."""
        with self._cv:
            while not self._waiting and not self._live and not self._closed:
                self._cv.wait()
            taken = []
            while self._waiting and len(self._live) + len(taken) < self.capacity and not self._closed:
                job = self._waiting.popleft()
                job.seq, self._taken = self._taken, self._taken + 1
                taken.append(job)
            self.metrics.waiting.set(len(self._waiting))
            return taken

    def _start(self, job: Job) -> None:
        """Submit a job taken up to the decoder (a bad argument answers it at once)."""
        p = job.params
        try:
            rid = self.decoder.submit(p.prompt_ids, p.max_tokens, p.sampling, head=self._request_head(p.head))
        except ApiError as e:
            job.emit("error", e)
            return
        except SpecheadError as e:
            job.emit("error", ApiError(400, str(e)))
            return
        self.metrics.queue_wait.observe(time.monotonic() - job.arrival)
        with self._cv:
            self._live[rid] = _Live(job, TextStream(self.decode, p.stop), time.perf_counter())

    def _work(self) -> None:
        dec, m = self.decoder, self.metrics
        while not self._closed:
            for job in self._admit():
                if not job.cancelled.is_set():
                    self._start(job)
                else:
                    job.done = True
            for rid, live in list(self._live.items()):
                if live.job.cancelled.is_set():
                    dec.cancel(rid)
            if not dec.busy:
                continue
            m.busy.set(1)
            try:
                events = dec.step()
            except Exception as e:  # never let one round take the worker down: fail what was in it
                log.exception("round failed")
                for rid, live in list(self._live.items()):
                    dec.cancel(rid)
                    live.job.emit("error", ApiError(500, f"internal error: {type(e).__name__}: {e}"))
                dec.step()  # drops the cancelled requests
                self._release(list(self._live))
                continue
            if dec.last_round:  # (a step that only dropped cancelled requests ran no round)
                m.batch_occupancy.set(dec.last_round)
                m.batch_rounds.inc()
                m.batch_request_rounds.inc(dec.last_round)
            for event in events:
                self._on_event(event)
            m.busy.set(int(dec.busy))

    def _release(self, rids: list[int]) -> None:
        with self._cv:
            for rid in rids:
                live = self._live.pop(rid, None)
                if live is not None:
                    live.job.done = True

    def _on_event(self, event: Event) -> None:
        live = self._live.get(event.rid)
        if live is None:
            return
        job, m = live.job, self.metrics
        live.tokens += event.tokens
        if not job.cancelled.is_set() and not live.stopped_by_text and event.tokens:
            piece = live.text.push(live.tokens)
            if piece:
                job.emit("text", piece)
            if live.text.stopped:  # a stop string: the request leaves at the next round, answered now
                live.stopped_by_text = True
                if event.result is None:  # answered before the decoder's result: the rounds it ran so far
                    self._finish(live, "stop", None, self.decoder.accept_lengths_so_far(event.rid))
                else:  # the same round ended the request
                    self._finish(live, "stop", event.result)
                self.decoder.cancel(event.rid)
        if event.result is None:
            return
        self._release([event.rid])
        m.prompt_tokens.inc(event.result.prompt_len)
        m.prefill_seconds.inc(event.result.prefill_s)
        m.generation_tokens.inc(len(live.tokens))  # work done, even for a request cancelled half-way
        if job.cancelled.is_set() or live.stopped_by_text:
            return
        self._finish(live, "stop" if event.result.stop_reason == "stop_token" else "length", event.result)

    def _finish(self, live: _Live, reason: str, result: GenerationResult | None, accepted: list[int] = ()) -> None:
        """Answer a request: from the decoder's ``result``, or (None) from its rounds' ``accepted`` lengths."""
        job, m = live.job, self.metrics
        piece = live.text.finish(live.tokens)
        if piece:
            job.emit("text", piece)
        decode_s = time.perf_counter() - live.started
        with self._cv:  # Retry-After: capacity requests decode at once, each for about this long
            self._service_s = 0.8 * self._service_s + 0.2 * decode_s
        tau = result.tau if result is not None else tau_of(list(accepted))
        stats = dict(result.head_stats) if result is not None else {}
        out = Outcome(job.seq, reason, len(job.params.prompt_ids), len(live.tokens), tau, decode_s, stats)
        m.tokens_per_s.set(out.completion_tokens / max(decode_s, 1e-9))
        m.tau.labels(job.params.head).set(tau)
        m.tau_summary.observe(tau)
        m.request_tokens_per_s.observe(out.completion_tokens / max(decode_s, 1e-9))
        if "active_size" in stats:
            m.active_vocab.labels(job.params.head).set(stats["active_size"])
        m.latency.observe(time.monotonic() - job.arrival)
        job.emit("done", out)
