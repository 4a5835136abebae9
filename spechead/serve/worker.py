"""The one decoding thread and its bounded FIFO queue: decoding is batch 1, so a request waits its turn,
a full queue is refused at once (503 with Retry-After) instead of piling up latency, and a request whose
client went away is dropped from the queue or stopped after the running verification round. The worker
hands text deltas to the request's asyncio handler through the loop, never blocking on it."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from spechead.decoding.decoder import Decoder, GenerationResult, tau_of
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
from spechead.tuning.tune import cached

log = logging.getLogger("spechead.serve")

MAX_CACHED_DECODERS = 4


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


class DecodeWorker:
    """Owns the target, drafter and per-head decoders, the bounded queue and the worker thread."""

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
    ) -> None:
        self.check_limits(queue_size, timeout, max_tokens)
        self.session, self.drafter, self.tree = session, drafter, tree
        self.default_head, self.queue_size, self.timeout = head, queue_size, timeout
        self.max_tokens, self.model_name, self.created = max_tokens, model_name, int(time.time())
        self.metrics = Metrics()
        self._tok_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        self._decoders: OrderedDict[str, Decoder] = OrderedDict()
        self._heads_ok: set[str] = set()  # head specs check_head built once
        self._default_tree: TreeConfig | None = None  # the default head's: other heads' tree when not tuned
        self._decoder(head)  # a bad --head fails at startup, not on the first request
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._taken = 0  # requests the worker has taken up, for Outcome.seq
        self._closed = False
        self._service_s = 1.0  # moving average of a request's time in the decoder, for Retry-After
        self._thread = threading.Thread(target=self._work, name="spechead-decoder", daemon=True)
        self._thread.start()

    @staticmethod
    def check_limits(queue_size: int, timeout: float, max_tokens: int) -> None:
        """The queue and per-request limits, checked before anything loads (``build_worker``) and here."""
        if queue_size < 0 or not timeout > 0 or max_tokens < 1:
            raise SpecheadError(
                "need --queue-size >= 0, --timeout > 0 and --max-tokens >= 1, "
                f"got {queue_size}, {timeout:g} and {max_tokens}"
            )

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
    def busy(self) -> bool:
        return self.decoding > 0

    capacity = 1  # requests decoded at once

    @property
    def decoding(self) -> int:
        """Requests being decoded now (one here; up to ``--max-batch`` in ``BatchWorker``)."""
        return int(self._running is not None)

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
        chunks = 0
        result: GenerationResult | None = None
        t0, prefill_s = time.perf_counter(), 0.0
        gen = dec.stream(p.prompt_ids, p.max_tokens, p.sampling, speculative=True)
        try:
            for item in gen:
                if isinstance(item, GenerationResult):
                    result = item
                    break
                if not chunks:  # the first chunk is the prefill's token
                    prefill_s = time.perf_counter() - t0
                tokens += item
                chunks += 1
                piece = text.push(tokens)
                if piece:
                    job.emit("text", piece)
                if text.stopped or job.cancelled.is_set():
                    break
        finally:
            gen.close()  # frees the decoder at once when we stop early
        decode_s = time.perf_counter() - t0
        m.prompt_tokens.inc(len(p.prompt_ids))
        m.prefill_seconds.inc(result.prefill_s if result is not None else prefill_s)
        m.generation_tokens.inc(len(tokens))  # work done, even for a request cancelled half-way
        if job.cancelled.is_set():
            return
        piece = text.finish(tokens)
        if piece:
            job.emit("text", piece)
        if result is not None:
            tau, stats = result.tau, result.head_stats
        else:  # stopped early (a stop string): the speculative rounds so far, as GenerationResult.tau counts them
            tau, stats = tau_of(dec.accept_lengths_so_far), dec.head.stats()
        finish = "stop" if text.stopped or (result and result.stop_reason == "stop_token") else "length"
        out = Outcome(job.seq, finish, len(p.prompt_ids), len(tokens), tau, decode_s, dict(stats))
        m.tokens_per_s.set(out.completion_tokens / max(decode_s, 1e-9))
        m.tau.labels(p.head).set(tau)
        m.tau_summary.observe(tau)
        if "active_size" in stats:
            m.active_vocab.labels(p.head).set(stats["active_size"])
        m.latency.observe(time.monotonic() - job.arrival)
        job.emit("done", out)
