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
    """Row counts of the target's verifications and the drafter's catch-up passes (forward pre-hooks)."""

    def __init__(self, target, drafter) -> None:
        self.verify: list[int] = []
        self.backbone: list[int] = []
        self.hooks = [
            target.register_forward_pre_hook(self._target, with_kwargs=True),
            drafter.register_forward_pre_hook(self._drafter, with_kwargs=True),
        ]

    def _target(self, module, args, kwargs) -> None:
        if kwargs.get("mask") is not None:
            self.verify.append(int(args[0].shape[0]))

    def _drafter(self, module, args, kwargs) -> None:
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if mask is None:
            self.backbone.append(int(args[0].shape[0]))

    def take(self) -> tuple[list[int], list[int]]:
        out = self.verify, self.backbone[1:]  # the first catch-up pass covers the prompt: a per-request cost
        self.verify, self.backbone = [], []
        return out

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.inference_mode()
def measure_costs(session, drafter, head_specs: list[str], ks: list[int], ids: list[int], tick) -> dict[str, Any]:
    """Median ms of the parts of a round, on a prefix of the first calibration prompt."""
    target = session.target
    dev = target.lm_head.weight.device
    want_aux = drafter.arch == "eagle3"
    x = torch.tensor(ids, dtype=torch.long, device=dev)
    p = x.numel()
    drafter.setup_cache(session.max_len + 64)
    target.prepack(1)
    drafter.prepack(1)  # as the decoders lay it out
    pre = target(x, 0, want_aux=want_aux)
    feats = drafter.target_features(pre)
    costs: dict[str, Any] = {"prefix": p}

    def cyc(t, n):  # n rows of t, cycling when it has fewer
        return t[torch.arange(n, device=dev) % t.shape[0]]

    def seen(rows: int, cached: int, nodes: Tensor) -> Tensor:  # a node sees the cache and its tree ancestors
        return torch.cat([torch.ones(rows, cached, dtype=torch.bool, device=dev), nodes], dim=1)

    one = x[-1:]

    def verify_fn(n: int) -> Callable[[], object]:
        toks = cyc(x, n)
        mask = seen(n, p, torch.ones(n, n, dtype=torch.bool, device=dev).tril())  # a chain: its ancestors
        pos = torch.arange(p, p + n, device=dev)
        return lambda: target(toks, p, positions=pos, mask=mask, want_aux=want_aux).logits.argmax(-1)

    step = lambda: target(one, p).logits.argmax(-1)  # noqa: E731
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
    costs["target_step_ms"] = ms.pop(0)
    costs["verify_ms"] = ms
    costs["drafter_ms"] = {}
    for n in range(1, DRAFTER_ROWS + 1):
        toks, f, pos = cyc(x, n), cyc(feats, n), torch.arange(p, p + n, device=dev)
        costs["drafter_ms"][n] = _median_ms(lambda toks=toks, f=f, pos=pos: drafter(toks, f, p, pos, None), 5, dev)
    tick("drafter")
    h_last = drafter(one, feats[-1:], p, torch.tensor([p], device=dev), None)[-1:]
    costs["drafter_tree_ms"] = {}
    for k in ks:
        toks, hk = cyc(x, k), h_last.expand(k, -1)
        mask = seen(k, p + 1, torch.eye(k, dtype=torch.bool, device=dev))  # one tree level
        pos = torch.full((k,), p + 1, dtype=torch.long, device=dev)
        costs["drafter_tree_ms"][k] = _median_ms(
            lambda toks=toks, hk=hk, mask=mask, pos=pos: drafter(toks, hk, p + 1, pos, mask), 5, dev
        )
    hin = drafter.head_input(h_last)
    costs["heads"] = {}
    for spec in head_specs:
        entry: dict[str, Any] = {}
        head = None
        try:
            head = session.draft_head(drafter, spec)
            rows = head.prompt_logit_rows(x.numel(), session.target.config)
            head.begin(x, pre.logits[-rows:] if head.needs_prompt_logits else None)
            entry["class"] = type(head).__name__
            for k in ks:
                root = _median_ms(lambda k=k, head=head: head.topk(hin, k), 5, dev)
                hk = hin.expand(k, -1).contiguous()
                level = root if k == 1 else _median_ms(lambda k=k, hk=hk, head=head: head.topk(hk, k), 5, dev)
                entry[k] = {"root": root, "level": level}
        except (SpecheadError, RuntimeError, ValueError) as e:  # a head this drafter or vocabulary cannot build
            entry = {"error": f"{type(e).__name__}: {e}"}
        costs["heads"][spec] = entry
        head = None  # free it before building the next
        tick(f"head {spec}")
    return costs
