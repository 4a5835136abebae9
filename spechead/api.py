"""The Python API: load a target with a drafter and a draft head by the names the command line takes, then
generate for one prompt or a batch, or stream one prompt's reply as text.

    llm = spechead.load("demo", drafter="demo", head="nanospec")
    out = llm.generate("Why is the sky blue?", max_new_tokens=64)
    print(out.text, out.tokens_per_s, out.tau)

Every option is checked by ``spechead.options`` (as the CLI's and the server's are): a bad one raises
``SpecheadError`` naming it. Decoding is lossless: greedy output is the target's own, token for token, and a
seeded request samples the same text whatever the drafter, head, tree or batch. An ``LLM`` decodes from one
thread at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spechead import options
from spechead.errors import SpecheadError

if TYPE_CHECKING:
    from spechead.decoding.decoder import Decoder, GenerationResult
    from spechead.decoding.sampling import SamplingConfig
    from spechead.decoding.session import Session
    from spechead.decoding.tree import TreeConfig
    from spechead.model.drafter import Drafter

Prompt = str | list[dict[str, str]]  # a text, or a conversation of {"role", "content"} turns


@dataclass
class Completion:
    """One request's reply and what decoding it measured."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    stop_reason: str  # "stop_token" | "max_new_tokens" | "context" | "cancelled"
    tokens_per_s: float  # new tokens over wall_s
    tau: float  # mean tokens committed per speculative round (1.0 without any)
    mode_rounds: dict[str, int] = field(default_factory=dict)  # target forwards after prefill, per decoding mode
    head_stats: dict[str, float] = field(default_factory=dict)  # the draft head's own counters
    wall_s: float = 0.0  # from submission to the last token, prefill (and any wait for a free lane) included
    prefill_s: float = 0.0


def make_decoder(
    session: Session, drafter: Drafter | None, head: str, tree: TreeConfig | str, max_batch: int
) -> Decoder:
    """The engine's decoder for these choices (``submit``, ``step``, ``cancel``, ``busy``): the one place the API
    builds one."""
    return session.decoder(drafter, head, tree, max_batch=max_batch)


class LLM:
    """A target with its drafter, draft head and tree, ready to generate (``load`` makes one by name)."""

    def __init__(
        self,
        session: Session,
        drafter: str | None = "demo",
        head: str = "full",
        tree: str | TreeConfig = "auto",
        method: str = "eagle",
        max_batch: int = 1,
        arch: str = "eagle2",
    ) -> None:
        """Decode on an open ``Session``; ``drafter`` None or ``method="ar"``: plain autoregressive decoding."""
        from spechead.decoding.session import resolve_drafter

        method = options.method(method)
        speculative = drafter is not None and method == "eagle"
        head = options.head(head) if speculative else head
        tree, max_batch = options.tree(tree), options.max_batch(max_batch)
        loaded = resolve_drafter(options.drafter(drafter), session.target, arch) if speculative else None
        self.session, self.head, self.max_batch = session, head, max_batch
        self.method = "eagle" if speculative else "ar"
        self.decoder = make_decoder(session, loaded, head, tree, max_batch)

    # -- prompts ------------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """A prompt's token ids: by the target's chat template (a base model's completion format), or with ``raw``
        the text as it is."""
        prompt = options.prompt(prompt)
        if raw and not isinstance(prompt, str):
            raise SpecheadError("prompt: raw=True takes a text, not a conversation", param="prompt")
        return options.prompt_tokens(self.session.encode(prompt, raw=raw), self.session.max_len)

    def decode(self, ids: list[int]) -> str:
        return self.session.decode(ids)

    # -- decoding -----------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        raw: bool = False,
    ) -> Completion | list[Completion]:
        """The reply to one prompt, or to each of a list of prompts (decoded ``max_batch`` at a time, results in
        the prompts' order). A prompt is a text (one user turn) or a conversation; ``raw``: texts to continue."""
        one = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict))
        if not one and (not isinstance(prompts, list) or not prompts):
            raise SpecheadError(
                f"prompts must be a prompt or a non-empty list of prompts, got {prompts!r:.60}", "prompts"
            )
        n, cfg = options.max_new_tokens(max_new_tokens), options.sampling(temperature, top_p, top_k, seed)
        ids = [self.encode(p, raw) for p in ([prompts] if one else prompts)]
        self._check_idle()
        rids: list[int] = []
        try:
            for prompt_ids in ids:
                rids.append(self.decoder.submit(prompt_ids, n, cfg))
            done: dict[int, GenerationResult] = {}
            while self.decoder.busy:
                done.update((e.rid, e.result) for e in self.decoder.step() if e.result is not None)
        finally:
            self._drop(rids)
        results = [self._completion(done[rid]) for rid in rids]
        return results[0] if one else results

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        raw: bool = False,
    ) -> Iterator[str]:
        """One prompt's reply as text pieces while it is decoded; the pieces join to ``generate``'s text (a piece
        ends only where the text so far decodes to whole characters). Leaving the loop early drops the request."""
        n, cfg = options.max_new_tokens(max_new_tokens), options.sampling(temperature, top_p, top_k, seed)
        ids = self.encode(prompt, raw)  # every check runs now, before the first piece is asked for
        self._check_idle()
        return self._pieces(ids, n, cfg)

    def _pieces(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig) -> Iterator[str]:
        rid = self.decoder.submit(ids, max_new_tokens, sampling)
        tokens: list[int] = []
        sent = 0
        try:
            while self.decoder.busy:
                for e in self.decoder.step():
                    tokens += e.tokens
                    text = self.session.decode(tokens)
                    end = len(text) if e.result is not None else len(text.rstrip("\ufffd"))  # a character's bytes
                    if end > sent:
                        yield text[sent:end]
                        sent = end
        finally:
            self._drop([rid])

    # -- helpers ------------------------------------------------------------------------------------------------
    def _check_idle(self) -> None:
        if self.decoder.busy:
            raise RuntimeError("this LLM is decoding another request (an unfinished stream): finish or close it first")

    def _drop(self, rids: list[int]) -> None:
        """Cancel what is still in flight (an error or a stream left early) and let the decoder release it."""
        if self.decoder.busy:
            for rid in rids:
                self.decoder.cancel(rid)
            self.decoder.step()

    def _completion(self, res: GenerationResult) -> Completion:
        return Completion(
            text=self.session.decode(res.tokens),
            token_ids=list(res.tokens),
            prompt_tokens=res.prompt_len,
            stop_reason=res.stop_reason,
            tokens_per_s=len(res.tokens) / res.wall_s if res.wall_s > 0 else 0.0,
            tau=res.tau,
            mode_rounds=dict(res.mode_rounds),
            head_stats=dict(res.head_stats),
            wall_s=res.wall_s,
            prefill_s=res.prefill_s,
        )


def load(
    target: str = "demo",
    drafter: str | None = "demo",
    head: str = "full",
    tree: str = "auto",
    *,
    method: str = "eagle",
    max_batch: int = 1,
    max_len: int = 4096,
    dtype: str = "auto",
    threads: int | None = None,
    arch: str = "eagle2",
    compile: bool = False,
) -> LLM:
    """Load a target, drafter and draft head by the command line's names.

    ``target``: ``demo``, ``gemma3-270m``, a Hugging Face model folder or a ``.gguf`` file. ``drafter``: ``demo``
    (the one shipped for the target), ``random`` or a drafter folder; None, or ``method="ar"``, decodes plainly
    autoregressively. ``head``: ``full``, ``fr:N``, ``vocabtrim:N``, ``nanospec[:W]``, ``lowrank[:R]``,
    ``hybrid``. ``dtype``: ``auto`` (a GGUF target's own integer blocks, ``gguf``; ``fp32`` for a folder), ``gguf``,
    ``q8``, ``q4`` or ``fp32``. ``tree``: ``auto`` (tuned for this machine on first use, then cached) or a spec such as
    ``2x1x4+lookup:8``. ``max_batch``: requests decoded together. ``threads``: torch's CPU threads for this
    process (None: as they are). ``arch``: ``eagle2`` or ``eagle3`` for ``demo`` and ``random`` drafters."""
    from spechead.tuning.tune import open_session

    target, max_len, threads = options.target(target), options.max_len(max_len), options.threads(threads)
    dtype = options.precision(dtype)
    if options.method(method) == "eagle" and drafter is not None:  # refused before the target loads
        options.head(head)
        options.drafter(drafter)
    options.tree(tree)
    options.max_batch(max_batch)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    session = open_session(target, max_len, dtype, compile=compile)
    return LLM(session, drafter, head, tree, method, max_batch, arch)
