"""Command line: ``spechead generate | bench | demo``. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import sys
import time

from spechead import options
from spechead.cli.args import (
    add_compile,
    add_drafter,
    add_head,
    add_max_len,
    add_max_new_tokens,
    add_sampling,
    add_target,
    add_threads,
    add_tree,
    set_threads,
)
from spechead.errors import SpecheadError

# At the process's exit, before Python's last collection walks the ~200k objects torch, transformers and the model
# keep alive (0.4-0.6 s of a generate's exit on an AMD EPYC Zen 3): frozen, they are left to the OS. At exit, not at
# main()'s return, so that a program calling main() keeps its collector as it was.
atexit.register(gc.freeze)

DEMO_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to English: Der Hund spielt im Garten mit einem roten Ball.",
]


def cmd_generate(args) -> int:
    from spechead.decoding.session import resolve_drafter
    from spechead.tuning.tune import open_session

    options.prompt(args.prompt)  # every option is refused before the target loads (spechead.options)
    if options.method(args.method) == "eagle":
        options.head(args.head)
        options.drafter(args.drafter)
    sampling = options.sampling(args.temperature, args.top_p, args.top_k, args.seed)
    tree = options.tree(args.tree)  # a TreeConfig, or ``auto``: the decoder resolves it (this machine's tuning)
    session = open_session(options.target(args.target), args.max_len, args.dtype, compile=args.compile)
    ids = options.prompt_tokens(session.encode(args.prompt, raw=args.raw), session.max_len)
    if args.method == "ar":
        dec = session.decoder()
    else:
        dec = session.decoder(resolve_drafter(args.drafter, session.target, args.arch), args.head, tree)
    stream = not args.json and sys.stdout.isatty()
    res, shown, printed = None, [], ""
    for item in dec.stream(ids, args.max_new_tokens, sampling, speculative=args.method != "ar"):
        if isinstance(item, list):
            if stream:  # print the text delta of every committed round
                shown += item
                text = session.decode(shown)
                print(text[len(printed) :], end="", flush=True)
                printed = text
        else:
            res = item
    text = session.decode(res.tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "tokens": res.tokens,
                    "prompt_tokens": res.prompt_len,
                    "new_tokens": len(res.tokens),
                    "tau": res.tau,
                    "tokens_per_s": len(res.tokens) / res.wall_s,
                    "stop_reason": res.stop_reason,
                    "timers_ms": res.timers_ms,
                    "head_stats": res.head_stats,
                    "mode_rounds": res.mode_rounds,
                    "tree": str(dec.tree) if args.method != "ar" else None,
                }
            )
        )
    else:
        if not stream:
            print(text)
        else:
            print()
        print(
            f"[{len(res.tokens)} tokens, {len(res.tokens) / res.wall_s:.1f} tok/s, tau {res.tau:.2f}, "
            f"{res.stop_reason}" + (f", tree {dec.tree}]" if args.method != "ar" else "]"),
            file=sys.stderr,
        )
    return 0


def cmd_demo(args) -> int:
    from spechead.decoding.session import resolve_drafter, shipped_drafter_path
    from spechead.tuning.tune import open_session

    t0 = time.perf_counter()
    session = open_session("demo", args.max_len)
    drafter = resolve_drafter("demo", session.target)
    which = "shipped demo drafter" if shipped_drafter_path() else "random drafter (no demo drafter shipped yet)"
    print(f"target SmolLM2-135M-Instruct loaded in {time.perf_counter() - t0:.1f}s; drafter: {which}")
    # plain AR, EAGLE-2 with its full head, and NanoSpec's active-vocabulary head on the same drafter
    ar = session.decoder()
    tree = options.tree(args.tree)
    methods = {
        "eagle (full head)": session.decoder(drafter, "full", tree),
        "nanospec": session.decoder(drafter, "nanospec", tree),
    }
    print("trees: " + ", ".join(f"{name} {dec.tree}" for name, dec in methods.items()))
    ok = True
    for prompt in DEMO_PROMPTS:
        ids = session.encode(prompt)
        ar.generate(ids, 8, speculative=False)  # warm-up
        a = ar.generate(ids, args.max_new_tokens, speculative=False)
        line = [f"ar {len(a.tokens) / a.wall_s:.1f} tok/s"]
        for name, dec in methods.items():
            dec.generate(ids, 8)  # warm-up
            s = dec.generate(ids, args.max_new_tokens)
            same = a.tokens == s.tokens
            ok &= same
            rungs = [f"{s.mode_rounds[m]} {m} rounds" for m in ("lean", "ar") if s.mode_rounds.get(m)]
            guarded = f" (guard: {', '.join(rungs)})" if rungs else ""
            line.append(
                f"{name} {len(s.tokens) / s.wall_s:.1f} tok/s, tau {s.tau:.2f}{guarded}, identical to AR: {same}"
            )
        print(f"\n> {prompt}\n{session.decode(a.tokens)}")
        print("  " + " | ".join(line))
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spechead", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a reply to one chat prompt (or continue a text: --raw, base models)")
    g.add_argument("--prompt", required=True)
    g.add_argument(
        "--raw",
        action="store_true",
        help="the prompt is plain text to continue, no chat template (a base model without one, e.g. "
        "gemma3-270m, is always prompted this way)",
    )
    g.add_argument("--method", default="eagle", help="ar or eagle")
    add_head(g, help="draft head, e.g. full")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_target(g)
    add_drafter(g)
    add_tree(g)
    add_max_new_tokens(g, 128)
    add_max_len(g)
    add_sampling(g)
    add_threads(g)
    add_compile(g)
    g.set_defaults(func=cmd_generate)

    from spechead.cli.bench import add_cli as add_bench

    add_bench(sub)

    d = sub.add_parser("demo", help="the demo: SmolLM2-135M-Instruct, AR vs speculative, outputs compared")
    add_max_new_tokens(d, 64)
    add_max_len(d, 2048)
    add_threads(d)
    add_tree(d)
    d.set_defaults(func=cmd_demo)
    from spechead.cli import coverage, export, heads, serve, train, tune, vocab

    for module in (train, vocab, heads, serve, coverage, tune, export):  # one file per group of subcommands
        module.add_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        set_threads(getattr(args, "threads", None))
        return args.func(args)
    except (SpecheadError, ValueError, FileNotFoundError) as e:
        print(f"spechead: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spechead: interrupted", file=sys.stderr)
        return 130
