"""This machine's costs of the parts of a round (median ms), and the row counts the real engine runs them at.

The prediction (``tuning.predict``) adds these parts up per candidate tree; the row counts come from hooks on
the target and drafter while the candidates decode (``Recorder``), so a part is priced at the sizes seen.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from spechead.decoding.sampling import greedy
from spechead.errors import SpecheadError

MAX_ROWS = 16  # the largest verification the tuner considers
SWEEPS = 4  # timed passes over the step and every verification size (after one to warm up)
DRAFTER_ROWS = 10  # catch-up passes: the tokens a round committed (up to a full lookup branch + the bonus)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    from spechead.tuning.measure import median_ms

    def run() -> None:
        fn()
        _sync(device)

    return median_ms(run, repeats)


class Recorder:
    """Row counts of the target's verifications (each request's part of ``Transformer.forward_batch`` with a tree
    mask) and the drafter's catch-up passes (a forward pre-hook: the calls without a mask)."""

    def __init__(self, target, drafter) -> None:
        self.verify: list[int] = []
        self.backbone: list[int] = []
        self.target, forward_batch = target, target.forward_batch

        def recorded(parts, want_aux=False):
            self.verify += [int(p.tokens.shape[0]) for p in parts if p.mask is not None]
            return forward_batch(parts, want_aux)

        target.forward_batch = recorded  # an instance attribute over the method, removed by close()
        self.hooks = [drafter.register_forward_pre_hook(self._drafter, with_kwargs=True)]

    def _drafter(self, module, args, kwargs) -> None:
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if mask is None:
            self.backbone.append(int(args[0].shape[0]))

    def take(self) -> tuple[list[int], list[int]]:
        out = self.verify, self.backbone[1:]  # the first catch-up pass covers the prompt: a per-request cost
        self.verify, self.backbone = [], []
        return out

    def close(self) -> None:
        self.target.__dict__.pop("forward_batch", None)
        for h in self.hooks:
            h.remove()


def _cycle(t: Tensor, n: int) -> Tensor:
    """n rows of t, cycling when it has fewer."""
    return t[torch.arange(n, device=t.device) % t.shape[0]]


def _seen(rows: int, cached: int, nodes: Tensor) -> Tensor:
    """The attention mask of ``rows`` tree nodes: each sees the ``cached`` positions and its tree ancestors."""
    return torch.cat([torch.ones(rows, cached, dtype=torch.bool, device=nodes.device), nodes], dim=1)


def _target_costs(target, x: Tensor, want_aux: bool, tick) -> tuple[float, dict[int, float]]:
    """(decode step ms, {n: ms of a verification of n chain tokens}) after the prompt ``x``."""
    dev, p = x.device, x.numel()

    def verify_fn(n: int) -> Callable[[], object]:
        toks = _cycle(x, n)
        mask = _seen(n, p, torch.ones(n, n, dtype=torch.bool, device=dev).tril())  # a chain: its ancestors
        pos = torch.arange(p, p + n, device=dev)
        return lambda: greedy(target(toks, p, positions=pos, mask=mask, want_aux=want_aux).logits)

    step = lambda: greedy(target(x[-1:], p).logits)  # noqa: E731
    # the step and the 16 verifications in turn, sweep after sweep, so that a shared host's drift falls on all
    # alike (timed one size after the other, a fast second can make several rows look cheaper than the step, and
    # the tuner pick too deep a tree)
    fns = {0: step} | {n: verify_fn(n) for n in range(1, MAX_ROWS + 1)}
    times: dict[int, list[float]] = {n: [] for n in fns}
    for sweep in range(SWEEPS + 1):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            if sweep:  # the first sweep warms up
                times[n].append(1e3 * (time.perf_counter() - t0))
            if sweep == SWEEPS:
                tick(f"verify {n}" if n else "target step")
    ms = {n: statistics.median(v) for n, v in times.items()}
    return ms.pop(0), ms


def _drafter_costs(drafter, x: Tensor, feats: Tensor, ks: list[int], tick) -> tuple[dict, dict, Tensor]:
    """({n: ms of a catch-up pass of n rows}, {k: ms of a tree-level pass of k rows}, the last catch-up state)."""
    dev, p = x.device, x.numel()
    catch_up = {}
    for n in range(1, DRAFTER_ROWS + 1):
        toks, f, pos = _cycle(x, n), _cycle(feats, n), torch.arange(p, p + n, device=dev)
        catch_up[n] = _median_ms(lambda toks=toks, f=f, pos=pos: drafter(toks, f, p, pos, None), 5, dev)
    tick("drafter")
    h_last = drafter(x[-1:], feats[-1:], p, torch.tensor([p], device=dev), None)[-1:]
    level = {}
    for k in ks:
        toks, hk = _cycle(x, k), h_last.expand(k, -1)
        mask = _seen(k, p + 1, torch.eye(k, dtype=torch.bool, device=dev))  # one tree level
        pos = torch.full((k,), p + 1, dtype=torch.long, device=dev)
        level[k] = _median_ms(lambda toks=toks, hk=hk, mask=mask, pos=pos: drafter(toks, hk, p + 1, pos, mask), 5, dev)
    return catch_up, level, h_last


def _head_costs(session, drafter, head_specs: list[str], ks: list[int], x: Tensor, pre, hin: Tensor, tick) -> dict:
    """Per head spec: ms of a root call (1 row) and of a tree-level call (k rows) per k, or the error that kept
    this drafter or vocabulary from building it."""
    out = {}
    for spec in head_specs:
        entry: dict[str, Any] = {}
        head = None
        try:
            head = session.draft_head(drafter, spec)
            rows = head.prompt_logit_rows(x.numel(), session.target.config)
            head.begin(x, pre.logits[-rows:] if head.needs_prompt_logits else None)
            entry["class"] = type(head).__name__
            for k in ks:
                root = _median_ms(lambda k=k, head=head: head.topk(hin, k), 5, x.device)
                hk = hin.expand(k, -1).contiguous()
                level = root if k == 1 else _median_ms(lambda k=k, hk=hk, head=head: head.topk(hk, k), 5, x.device)
                entry[k] = {"root": root, "level": level}
        except (SpecheadError, RuntimeError, ValueError) as e:  # a head this drafter or vocabulary cannot build
            entry = {"error": f"{type(e).__name__}: {e}"}
        out[spec] = entry
        head = None  # free it before building the next
        tick(f"head {spec}")
    return out


@torch.inference_mode()
def measure_costs(session, drafter, head_specs: list[str], ks: list[int], ids: list[int], tick) -> dict[str, Any]:
    """Median ms of the parts of a round, on a prefix of the first calibration prompt."""
    target = session.target
    want_aux = drafter.arch == "eagle3"
    x = torch.tensor(ids, dtype=torch.long, device=target.model.norm.weight.device)
    drafter.setup_cache(session.max_len + 64)
    target.prepack()
    drafter.prepack(target.precision)  # as the decoders lay it out
    pre = target(x, 0, want_aux=want_aux)
    feats = drafter.target_features(pre)
    costs: dict[str, Any] = {"prefix": x.numel()}
    costs["target_step_ms"], costs["verify_ms"] = _target_costs(target, x, want_aux, tick)
    costs["drafter_ms"], costs["drafter_tree_ms"], h_last = _drafter_costs(drafter, x, feats, ks, tick)
    costs["heads"] = _head_costs(session, drafter, head_specs, ks, x, pre, drafter.head_input(h_last), tick)
    return costs
