"""Offline replay of NanoSpec's active set against the target's own greedy continuation."""

from __future__ import annotations

import torch


# -- measurement: the oracle-drafter replay behind docs/nanospec.md -------------------------------
@torch.inference_mode()
def oracle_replay(session, prompts: list[list[int]], specs: list[str], tokens: int = 64, depth: int = 5) -> dict:
    """Acceptance proxy without a trained drafter: the drafter's state is the target's own final state,
    so the full head always drafts the target's next token and a restricted head drafts it exactly when
    its candidate set can score it. Rounds draft a chain of up to ``depth`` tokens, commit the accepted
    ones plus the target's token, and show the head the chain with the target's logits along it.
    Returns per spec: tau (tokens per round, at most depth+1), coverage, final active size and the median
    milliseconds per draft call with the round's update amortised in."""
    import statistics
    import time

    from spechead.heads.base import make_head

    tgt = session.target
    runs = []
    for ids in prompts:  # one greedy pass per prompt: states, logits and tokens to replay
        ids_t = torch.tensor(ids)
        out = tgt(ids_t, 0)
        hs, lg, toks, pos = [out.hidden[-1]], [out.logits[-1]], [], ids_t.numel()
        for _ in range(tokens + depth + 1):
            toks.append(int(lg[-1].argmax()))
            o = tgt(torch.tensor([toks[-1]]), pos)
            pos += 1
            hs.append(o.hidden[-1])
            lg.append(o.logits[-1])
        runs.append((ids_t, out.logits, torch.stack(hs), torch.stack(lg), toks))
    w = tgt.lm_head.weight
    results = {}
    for spec in specs:
        head = make_head(spec, w, None, tgt.config.vocab_size)
        taus, covs, sizes, ms = [], [], [], []
        for ids_t, plog, hs, lg, toks in runs:
            rows = head.prompt_logit_rows(ids_t.numel(), tgt.config)
            head.begin(ids_t, plog[-rows:] if head.needs_prompt_logits else None)
            t, acc = 0, []
            while t < tokens:
                t0, chain = time.perf_counter(), []
                while len(chain) < depth and (not chain or chain[-1] == toks[t + len(chain) - 1]):
                    chain.append(int(head.topk(hs[t + len(chain)][None], 1)[1][0, 0]))
                a = next((j for j, c in enumerate(chain) if c != toks[t + j]), len(chain))
                root = toks[t - 1] if t else int(ids_t[-1])
                head.observe(torch.tensor([root] + chain), lg[t : t + len(chain) + 1], toks[t : t + a + 1])
                ms.append((time.perf_counter() - t0) * 1e3 / len(chain))
                acc.append(a + 1)
                t += a + 1
            st = head.stats()
            taus.append(sum(acc) / len(acc))
            covs.append(st.get("coverage", 1.0))
            sizes.append(st.get("active_size", 0.0))
        results[spec] = {
            "tau": statistics.mean(taus),
            "coverage": statistics.mean(covs),
            "active_size": statistics.mean(sizes),
            "ms_per_call": statistics.median(ms),
            "per_prompt_tau": taus,
        }
    return results


def main(argv: list[str] | None = None) -> None:
    """``python -m spechead.bench.oracle --categories writing,qa --limit 1 --tokens 64 SPEC...``"""
    import argparse
    import json
    import os
    from pathlib import Path

    from spechead.bench.suites import EVAL_DIR_ENV, load_suite
    from spechead.decoding.session import Session

    p = argparse.ArgumentParser(prog="python -m spechead.bench.oracle", description=oracle_replay.__doc__)
    p.add_argument("specs", nargs="+")
    p.add_argument("--suite", default="spec-bench")
    p.add_argument(
        "--eval-dir",
        default=os.environ.get(EVAL_DIR_ENV, "../shared/data/eval"),
        help=f"folder of the named suites (default: ${EVAL_DIR_ENV}, else ../shared/data/eval from the checkout)",
    )
    p.add_argument("--categories", default="writing,qa,translation,summarization,math_reasoning,coding")
    p.add_argument("--limit", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    session = Session.open("demo", max_len=2048)
    rows = load_suite(args.suite, args.limit, args.categories.split(","), eval_dir=Path(args.eval_dir))
    prompts = [session.encode([{"role": "user", "content": r["turns"][0]}]) for r in rows]
    res = oracle_replay(session, prompts, ["full", *args.specs], args.tokens, args.depth)
    for spec, r in res.items():
        print(f"{spec:48s}", json.dumps({k: round(v, 3) for k, v in r.items() if k != "per_prompt_tau"}), flush=True)


if __name__ == "__main__":
    main()
