"""Where a drafter training step's time goes on a device: one pack's unroll, backward and optimizer step for the
EAGLE-2, EAGLE-3 and rank-72 drafters of a random target of the demo's shape (SmolLM2-135M: d=576, 30 layers,
V=49152), median of timed steps after warm-up (the device synchronized around each), at two pack sizes, then
the profiler's top kernels and the host's share. Also the target's forward over one online chunk.

    python results/training/stage10/step_profile.py --device cuda
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from spechead.model.loading import load_target  # noqa: E402
from spechead.training.config import TrainConfig, make_drafter  # noqa: E402
from spechead.training.data import Example  # noqa: E402
from spechead.training.loop import OnlineChunks, unroll_ready  # noqa: E402
from spechead.training.ttt import make_batch, run_ttt  # noqa: E402


def demo_shaped_target(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def train_step(j, lo, hi, dev, drafter, target, opt, params, chunk, cfg, teacher) -> int:
    """One optimizer step on the pack of examples lo..hi of ``chunk``, as train() takes it; returns its tokens."""
    b = make_batch(chunk, lo, hi).to(dev)
    res = run_ttt(drafter, target, b, cfg, torch.Generator().manual_seed(j), teacher)
    opt.zero_grad(set_to_none=False)
    res.loss.backward()
    float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    opt.step()
    float(res.loss.detach())
    return res.tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--examples", type=int, default=400, help="synthetic examples (fewer to rehearse on a CPU)")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # as train-drafter's accelerator() sets it
        torch.backends.cudnn.allow_tf32 = True
    tmp = tempfile.TemporaryDirectory()  # a 538 MB target: removed when the script ends
    target, _ = load_target(str(demo_shaped_target(Path(tmp.name) / "t")), device=args.device)
    dev = target.lm_head.weight.device
    rng = random.Random(0)
    examples = []
    for _ in range(args.examples):
        n_prompt, n_reply = rng.randrange(40, 500), rng.randrange(60, 193)
        ids = [rng.randrange(3, 49152) for _ in range(n_prompt + n_reply)]
        examples.append(Example(ids, [False] * n_prompt + [True] * n_reply))
    for arch, head, pack in [("eagle2", "full", 4096), ("eagle2", "full", 2048), ("eagle3", "full", 4096),
                             ("eagle3", "lowrank:72", 4096)]:  # fmt: skip
        cfg = TrainConfig(arch=arch, head=head, steps_ttt=3, pack_tokens=pack, ce_positions=1024, noise=0.1)
        online = OnlineChunks(target, examples, 131072, pack, arch == "eagle3")
        sync(dev)
        t0 = time.perf_counter()
        chunk = online.get(0)
        sync(dev)
        chunk_s = time.perf_counter() - t0
        drafter, teacher = make_drafter(target, cfg)
        unroll_ready(drafter)
        drafter.to(dev)
        teacher = teacher.to(dev) if teacher is not None else None
        params = [q for q in drafter.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=dev.type == "cuda" or None)
        starts, lo = chunk.starts, 0
        packs = []
        while lo < len(starts) - 1 and len(packs) < args.steps + 3:
            hi = lo + 1
            while hi < len(starts) - 1 and int(starts[hi + 1] - starts[lo]) <= pack:
                hi += 1
            packs.append((lo, hi))
            lo = hi

        run = dict(drafter=drafter, target=target, opt=opt, params=params, chunk=chunk, cfg=cfg, teacher=teacher)

        times, toks = [], []
        warm = 3 if len(packs) > 4 else 1
        for j, (lo, hi) in enumerate(packs):
            sync(dev)
            t0 = time.perf_counter()
            n = train_step(j, lo, hi, dev, **run)
            sync(dev)
            if j >= warm:
                times.append(time.perf_counter() - t0)
                toks.append(n)
        med = statistics.median(times)
        print(
            f"{arch} {head} pack {pack}: step {med * 1e3:.1f} ms median of {len(times)} "
            f"({statistics.median(toks) / med:.0f} tok/s); online chunk of {chunk.ids.numel()} tokens {chunk_s:.2f} s",
            flush=True,
        )
        if dev.type == "cuda" and pack == 4096:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for j, (lo, hi) in enumerate(packs[:2]):
                    train_step(100 + j, lo, hi, dev, **run)
                sync(dev)
            ev = prof.key_averages()
            cuda_us = sum(e.self_device_time_total for e in ev) / 2
            print(f"  per step: device busy {cuda_us / 1e3:.1f} ms; top device ops:")
            for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:10]:
                print(f"    {e.self_device_time_total / 2e3:8.2f} ms  {e.count // 2:5d}x  {e.key[:70]}")
        del online, chunk, drafter, opt, run
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
