"""Is the demo target's prefill at its compute floor? The prefill's FLOP rate (2 x the decoder layers' parameters x
tokens: attention scores, the embedding lookup and the one row of logits left out) at the benchmark's prompt
lengths, next to MKL's sgemm on 2048-square matrices, both on ``--threads``.

    .venv/bin/python results/bench/step-cost/prefill.py --threads 2 > results/bench/portable/s22/prefill.txt
"""

import argparse

import torch

from spechead.decoding.session import Session
from spechead.tuning.measure import machine_facts, median_ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="53,210,660,769")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    session = Session.open("demo", max_len=2048)
    target = session.target
    target.prepack(1)  # laid out as AR decoding lays it out
    params = sum(t.numel() for t in target.model.layers.parameters())
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    print(machine_facts(args.threads))
    print(f"sgemm 2048^3: {2 * 2048**3 / median_ms(lambda: a @ b, args.repeats) / 1e6:.0f} GFLOP/s")
    with torch.inference_mode():
        for n in (int(x) for x in args.lengths.split(",")):
            ids = torch.arange(n) % 1000 + 100
            s = median_ms(lambda ids=ids: target(ids, 0, logits_rows=slice(-1, None)), args.repeats) / 1e3
            print(f"prefill {n} tokens: {1e3 * s:.0f} ms, {2 * params * n / s / 1e9:.0f} GFLOP/s (layers)")


if __name__ == "__main__":
    main()
