"""``spechead serve --max-batch N``: the batched decoder under the same queue, limits and metrics as the one-at-a-time
worker. A request joins the batch at the next round with a free lane (until then it waits in the bounded
queue), its text streams as each round commits its tokens, and a request that is cancelled, disconnects,
times out or meets a stop string leaves at the next round, which frees its lane for the next in line."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from spechead.decoding.batch import BatchDecoder, BatchEvent
from spechead.decoding.decoder import tau_of
from spechead.decoding.session import AUTO_TREE, Session
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead
from spechead.model.drafter import Drafter
from spechead.model.loading import DEMO_NAME
from spechead.serve.schema import ApiError
from spechead.serve.stream import TextStream
from spechead.serve.worker import MAX_CACHED_DECODERS, DecodeWorker, Job, Outcome

log = logging.getLogger("spechead.serve")
MAX_BATCH = 64  # a server's KV cache holds max_len positions for every slot (64 x 2048 x 30 layers: 3.6 GB, demo)


@dataclass
class _Live:
    """A request in the batch: its job, text stream and tokens so far."""

    job: Job
    text: TextStream
    started: float
    tokens: list[int] = field(default_factory=list)
    stopped_by_text: bool = False


class BatchWorker(DecodeWorker):
    """Up to ``max_batch`` requests decoded together (``decoding.batch.BatchDecoder``); one worker thread."""

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
        max_batch: int = 8,
    ) -> None:
        self.check_capacity(max_batch)
        self.capacity = max_batch
        self._batch: BatchDecoder | None = None
        self._live: dict[int, _Live] = {}
        # stateless heads other than the default, shared by their requests; the least recently used go beyond a
        # few (a request holds its own reference, so eviction never touches one in flight)
        self._heads: OrderedDict[str, DraftHead] = OrderedDict()
        super().__init__(session, drafter, head, tree, queue_size, timeout, max_tokens, model_name)

    @staticmethod
    def check_capacity(max_batch: int) -> None:
        """``--max-batch``, checked before anything loads (``build_worker``) and here."""
        if not 1 <= max_batch <= MAX_BATCH:
            raise SpecheadError(f"--max-batch must be in [1, {MAX_BATCH}], got {max_batch}")

    @property
    def decoding(self) -> int:
        return len(self._live)

    def _decoder(self, head: str):
        """The batch-1 decoder validates the head and, for ``auto``, gives the tuned tree the batch rule starts
        from; the first call also builds the batched decoder."""
        dec = super()._decoder(head)
        if self._batch is None:
            tree = AUTO_TREE if self.tree is None or self.tree == AUTO_TREE else self.tree
            self._batch = self.session.batch_decoder(self.drafter, head, tree, self.capacity, base=dec.tree)
        return dec

    def _request_head(self, spec: str) -> DraftHead | None:
        """None: the batch's default head; a stateless head is built once and shared, a stateful one per request."""
        if spec == self.default_head:
            return None
        if spec in self._heads:
            self._heads.move_to_end(spec)
            return self._heads[spec]
        head = self.build_head(spec)
        if not head.per_round:
            self._heads[spec] = head
            while len(self._heads) > MAX_CACHED_DECODERS:
                self._heads.popitem(last=False)
        return head

    def close(self, wait: float = 10.0) -> None:
        with self._cv:
            for live in self._live.values():
                live.job.cancelled.set()
                live.job.emit("error", ApiError(503, "the server is shutting down", code="shutting_down"))
        super().close(wait)

    # -- the loop ---------------------------------------------------------------------------------
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

    def _work(self) -> None:
        batch = self._batch
        while not self._closed:
            for job in self._admit():
                if job.cancelled.is_set():
                    continue
                p = job.params
                try:
                    rid = batch.submit(p.prompt_ids, p.max_tokens, p.sampling, self._request_head(p.head))
                except ApiError as e:
                    job.emit("error", e)
                    continue
                except SpecheadError as e:
                    job.emit("error", ApiError(400, str(e)))
                    continue
                self.metrics.queue_wait.observe(time.monotonic() - job.arrival)
                with self._cv:
                    self._live[rid] = _Live(job, TextStream(self.decode, p.stop), time.perf_counter())
            for rid, live in list(self._live.items()):
                if live.job.cancelled.is_set():
                    batch.cancel(rid)
            if not batch.busy:
                continue
            self.metrics.busy.set(1)
            try:
                events = batch.step()
            except Exception as e:  # never let one round take the worker down: fail what was in it
                log.exception("batched round failed")
                for rid, live in list(self._live.items()):
                    batch.cancel(rid)
                    live.job.emit("error", ApiError(500, f"internal error: {type(e).__name__}: {e}"))
                batch.step()  # drops the cancelled requests
                self._release(list(self._live))
                continue
            if batch.last_round:  # (a step that only dropped cancelled requests ran no round)
                self.metrics.batch_occupancy.set(batch.last_round)
                self.metrics.batch_rounds.inc()
                self.metrics.batch_request_rounds.inc(batch.last_round)
            for event in events:
                self._on_event(event)
            self.metrics.busy.set(int(batch.busy))

    def _release(self, rids: list[int]) -> None:
        with self._cv:
            for rid in rids:
                live = self._live.pop(rid, None)
                if live is not None:
                    live.job.done = True

    def _on_event(self, event: BatchEvent) -> None:
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
                if event.result is None:  # answered now, before the decoder's result: the rounds it ran so far
                    self._finish(live, "stop", None, self._batch.accept_lengths_so_far(event.rid))
                else:  # the same round ended the request
                    self._finish(live, "stop", event.result)
                self._batch.cancel(event.rid)
        if event.result is None:
            return
        self._release([event.rid])
        m.prompt_tokens.inc(event.result.prompt_len)
        m.prefill_seconds.inc(event.result.prefill_s)
        m.generation_tokens.inc(len(live.tokens))
        if job.cancelled.is_set() or live.stopped_by_text:
            return
        self._finish(live, "stop" if event.result.stop_reason == "stop_token" else "length", event.result)

    def _finish(self, live: _Live, reason: str, result, accepted: list[int] | None = None) -> None:
        """Answer a request: from the decoder's ``result``, or (None) from its rounds' ``accepted`` lengths."""
        job, m = live.job, self.metrics
        piece = live.text.finish(live.tokens)
        if piece:
            job.emit("text", piece)
        decode_s = time.perf_counter() - live.started
        with self._cv:  # Retry-After: capacity requests decode at once, each for about this long
            self._service_s = 0.8 * self._service_s + 0.2 * decode_s
        tau = result.tau if result is not None else tau_of(accepted or [])
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
