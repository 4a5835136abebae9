"""transformers' batched greedy generate on the demo target, fp32 vs bf16: the figures behind gen-data's --dtype.

python results/training/stage4/gen_speed.py float32 32   # then bfloat16 32, bfloat16 64
"""

import sys
import time

import torch
from transformers import AutoModelForCausalLM

from spechead.model.loading import resolve_target

torch.set_num_threads(2)
dtype, batch = getattr(torch, sys.argv[1]), int(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(resolve_target("demo"), dtype=dtype).eval()
ids = torch.randint(100, 40000, (batch, 100))
with torch.inference_mode():
    model.generate(input_ids=ids[:, :20], max_new_tokens=4, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    dt = time.perf_counter() - t0
print(sys.argv[1], batch, f"{batch * 64 / dt:.0f} tok/s")
