"""spechead's Python API: the demo target with its shipped drafter and NanoSpec's draft head."""

import spechead

llm = spechead.load("demo", drafter="demo", head="nanospec", tree="auto")
out = llm.generate("Why is the sky blue? One sentence.", max_new_tokens=32)
print(out.text)
print(f"[{out.tokens_per_s:.1f} tokens/s, tau {out.tau:.2f}]")
for piece in llm.stream("Name three primary colours.", max_new_tokens=24):
    print(piece, end="", flush=True)
print()
