"""Gemma 3 270M (real weights): spechead's forward against transformers' on the same converted folder.

Prints the max abs logit difference and argmax agreement over each prompt, then greedy AR in both
engines (transformers' ``generate``) and where, if anywhere, they first differ (with the top-2 margin
there: a near-tie is where fp32 summation order can legitimately flip an argmax).
Run: .venv/bin/python results/gemma3/parity.py [--new 64] [--json results/gemma3/parity.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from spechead.decoding.decoder import Decoder
from spechead.decoding.tree import TreeConfig
from spechead.model.loading import load_target, resolve_target
from spechead.model.tokenizer import load_tokenizer

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The capital of France is",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea,",
    # longer than the 512-token window: the local layers' mask is exercised in the prefill and every step after
    "Numbers in words: " + ", ".join(f"{i} is number {i}" for i in range(1, 80)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_target("gemma3-270m")
    tok = load_tokenizer(folder)
    ours, _ = load_target("gemma3-270m")
    ours.prepack(16)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    dec = Decoder(ours, None, None, TreeConfig.chain(1), 1024, [])
    rows = []
    for text in PROMPTS:
        ids = torch.tensor(tok(text)["input_ids"])
        ours.setup_cache(1024)
        with torch.inference_mode():
            a = ours(ids, 0).logits
            b = ref(ids[None]).logits[0]
            t0 = time.perf_counter()
            mine = dec.generate(ids, args.new, speculative=False).tokens
            t1 = time.perf_counter()
            theirs = ref.generate(ids[None], max_new_tokens=args.new, do_sample=False, eos_token_id=None)[0, len(ids) :]
            t2 = time.perf_counter()
        theirs = theirs.tolist()
        first = next((i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y), None)
        margin = None
        if first is not None:  # the reference's top-2 margin at the first difference
            with torch.inference_mode():
                z = ref(torch.tensor([ids.tolist() + theirs[:first]])).logits[0, -1].topk(2).values
            margin = float(z[0] - z[1])
        row = {
            "prompt": text,
            "prompt_tokens": len(ids),
            "max_abs_logit_diff": float((a - b).abs().max()),
            "argmax_identical": bool(torch.equal(a.argmax(-1), b.argmax(-1))),
            "greedy_tokens_compared": len(mine),
            "greedy_first_difference": first,
            "top2_margin_at_difference": margin,
            "ours_tok_s": len(mine) / (t1 - t0),
            "hf_tok_s": len(theirs) / (t2 - t1),
            "text": tok.decode(mine),
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "new_tokens": args.new, "prompts": rows}, f, indent=2)


if __name__ == "__main__":
    main()
