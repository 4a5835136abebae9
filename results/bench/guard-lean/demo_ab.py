"""A/B on the demo's three prompts: decoders interleaved per repeat, median tok/s over the repeats, ratios to AR.

Run from the repository root (twentieth session, CPU A: Intel Xeon, AVX-512, 2 threads)::

    .venv/bin/python results/bench/guard-lean/demo_ab.py trees full 2x1x4+lookup:8 1x0x2+lookup:8 --repeats 5
    .venv/bin/python results/bench/guard-lean/demo_ab.py shared full 2x1x4+lookup:8 --repeats 7
    .venv/bin/python results/bench/guard-lean/demo_ab.py lean full,nanospec auto --repeats 5

``trees HEAD TREE...``: the head on each tree, guard off (what each tree is worth per prompt). ``shared HEAD TREE``:
the full head on the target's laid-out LM head (``BlockedWeight.of``) against the same head on a private copy of
it, guard on. ``lean HEADS TREE``: each head with the guard's lean rung and without it (``GuardConfig(lean=False)``).
Every speculative output is checked against AR's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from spechead.cli.commands import DEMO_PROMPTS
from spechead.decoding.guard import GuardConfig
from spechead.decoding.session import resolve_drafter
from spechead.kernels.linear import BlockedWeight
from spechead.tuning.tune import open_session


def decoders(session, drafter, mode: str, heads: list[str], trees: list[str]) -> dict:
    if mode == "trees":
        return {t: session.decoder(drafter, heads[0], t, guard=None) for t in trees}
    if mode == "shared":
        shared = session.decoder(drafter, "full", trees[0])
        private = session.decoder(drafter, "full", trees[0])
        assert shared.head.lin.blocked is session.target.lm_head.blocked
        private.head.lin.blocked = BlockedWeight(private.head.weight.detach())
        return {"shared": shared, "private": private}
    out = {}
    for head in heads:
        out[f"{head} lean"] = session.decoder(drafter, head, trees[0])
        out[f"{head} no lean"] = session.decoder(drafter, head, trees[0], guard=GuardConfig(lean=False))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["trees", "shared", "lean"])
    p.add_argument("heads", help="comma-separated heads (trees, shared: the first)")
    p.add_argument("trees", nargs="+", help="tree specs or auto (shared, lean: the first)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(2)
    session = open_session("demo", 2048)
    drafter = resolve_drafter("demo", session.target)
    ar = session.decoder()
    decs = decoders(session, drafter, args.mode, args.heads.split(","), args.trees)
    print(torch.backends.cpu.get_cpu_capability(), {name: str(d.tree) for name, d in decs.items()})
    for prompt in DEMO_PROMPTS:
        ids = session.encode(prompt)
        rates: dict[str, list[float]] = {}
        last = {}
        for _ in range(args.repeats):
            for name, d in [("ar", ar), *decs.items()]:
                spec = name != "ar"
                d.generate(ids, 8, speculative=spec)  # warm-up
                r = d.generate(ids, args.max_new_tokens, speculative=spec)
                rates.setdefault(name, []).append(len(r.tokens) / r.wall_s)
                last[name] = r
        med = {k: statistics.median(v) for k, v in rates.items()}
        same = all(r.tokens == last["ar"].tokens for r in last.values())
        cells = [f"{k} {med[k] / med['ar']:.3f}x (tau {last[k].tau:.2f}, {last[k].mode_rounds})" for k in decs]
        print(f"{prompt[:24]}: ar {med['ar']:.1f} tok/s | " + " | ".join(cells) + f" | identical: {same}", flush=True)


if __name__ == "__main__":
    main()
