"""llama.cpp as a peer in ``spechead bench``, through the optional package ``llama-cpp-python``.

``llamacpp`` decodes the same GGUF file the spechead target was converted from, fed the same prompt ids the engine
encodes, greedy, with the same thread count, token budget and stop tokens; ``llamacpp-lookup[:N]`` is its
prompt-lookup speculative decoding (``LlamaPromptLookupDecoding`` as the draft model, N tokens a round). Both compute
on the file's quantized blocks, each with its own activation rounding and kernels (spechead at ``gguf``; at ``fp32``
on a float copy), so their outputs may differ: the benchmark reports how often they agree and never counts
llama.cpp's outputs among spechead's mismatches.

On CPUs with AMX, llama.cpp's weight-repacking buffer types (AMX and the CPU repack) may crash the process, so there
the model loads without them (``use_extra_bufts=False``) where the installed version has that option; elsewhere it
runs with llama.cpp's defaults, repacking included. The setting is recorded with the results.
"""

from __future__ import annotations

import inspect
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from spechead.bench.methods import MethodSpec
from spechead.bench.runs import Run
from spechead.decoding.sampling import SamplingConfig
from spechead.errors import SpecheadError
from spechead.model.loading import target_gguf
from spechead.tuning.measure import cpuinfo_field

INSTALL = "pip install llama-cpp-python"  # or `pip install 'spechead[llamacpp]'`; CMAKE_ARGS="-DGGML_NATIVE=ON" tunes


def missing() -> str | None:
    """Why llama.cpp cannot run here (one line naming the install command), or None where it can."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: the package is there but its shared library does not load
        detail = "is not installed" if isinstance(e, ImportError) else f"does not load ({e})"
        return f"llama.cpp methods need the package llama-cpp-python, which {detail}: run `{INSTALL}`"
    return None


def unavailable(specs: list[MethodSpec]) -> dict[str, str]:
    """{method: reason} for the llama.cpp methods that cannot run here; checked before any model loads."""
    wanted = [s.name for s in specs if s.kind == "llamacpp"]
    reason = missing() if wanted else None
    return dict.fromkeys(wanted, reason) if reason else {}


class CountedDraft:
    """A draft model that counts its calls: in llama-cpp-python's ``generate`` each call opens one verification
    round, which gives the rounds (and so tau) that llama.cpp does not report."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(input_ids, **kwargs)


@contextmanager
def _without_extra_bufts(lib: Any) -> Iterator[None]:
    """Make ``lib.llama_model_default_params`` (which ``Llama`` reads when it loads a model) return parameters with
    ``use_extra_bufts`` off, for versions whose ``Llama`` does not take the option itself."""
    original = lib.llama_model_default_params

    def patched() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = patched
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def load_llama(model_path: str, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``Llama(model_path, **kwargs)``, on an AMX CPU without the extra buffer types where this version can turn them
    off; returns (model, {"use_extra_bufts": False or None for llama.cpp's default, "set_by": how}) for the results."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    if "amx_tile" not in (cpuinfo_field("flags") or "").split():
        return llama_cpp.Llama(model_path, **kwargs), {"use_extra_bufts": None, "set_by": "default (no AMX)"}
    if "use_extra_bufts" in inspect.signature(llama_cpp.Llama.__init__).parameters:
        llm = llama_cpp.Llama(model_path, use_extra_bufts=False, **kwargs)
        return llm, {"use_extra_bufts": False, "set_by": "Llama(use_extra_bufts=False)"}
    if "use_extra_bufts" in {f[0] for f in lib.llama_model_params._fields_}:
        with _without_extra_bufts(lib):
            llm = llama_cpp.Llama(model_path, **kwargs)
        return llm, {"use_extra_bufts": False, "set_by": "llama_model_params.use_extra_bufts = False"}
    return llama_cpp.Llama(model_path, **kwargs), {"use_extra_bufts": None, "set_by": "not in this version"}


class LlamaCppRunner:
    """One method's llama.cpp model; called like every runner with the prompt's ids. Each call starts from an empty
    KV cache (llama-cpp-python would otherwise reuse the previous prompt's common prefix), and the time to the first
    token is the prefill, so decode-only tokens/s is measured as for the engine's methods."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, stop_ids: list[int], lookup: int = 0) -> None:
        import llama_cpp

        kwargs: dict[str, Any] = {"n_ctx": n_ctx, "n_threads": threads, "n_threads_batch": threads}
        kwargs.update(n_gpu_layers=0, verbose=False)
        self.draft: CountedDraft | None = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.draft = CountedDraft(LlamaPromptLookupDecoding(num_pred_tokens=lookup))
            kwargs["draft_model"] = self.draft
            kwargs["logits_all"] = True  # else llama-cpp-python sizes its logits for one batch, not for the context
        try:
            self.llm, bufts = load_llama(str(gguf), **kwargs)
        except (ValueError, RuntimeError, OSError) as e:
            raise SpecheadError(f"llama.cpp could not load {gguf}: {e}") from e
        self.stop_ids = set(stop_ids)
        self.workdir: tempfile.TemporaryDirectory | None = None  # where an assembled GGUF lives, kept with it
        self.config: dict[str, Any] = {
            "package": f"llama-cpp-python {llama_cpp.__version__}",
            "gguf": str(gguf),
            "threads": threads,
            "n_ctx": n_ctx,
            "n_batch": self.llm.n_batch,
            "use_extra_bufts": bufts["use_extra_bufts"],
            "use_extra_bufts_set_by": bufts["set_by"],
            "lookup": {"num_pred_tokens": lookup, "max_ngram_size": 2} if lookup else None,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        }

    def __call__(self, ids: list[int], max_new: int, sampling: SamplingConfig) -> Run:
        llm, draft = self.llm, self.draft
        llm.reset()
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        greedy = sampling.greedy
        sampler = {
            "temp": 0.0 if greedy else sampling.temperature,
            "top_k": 1 if greedy else sampling.top_k,  # 0: no top-k cut, in llama.cpp as here
            "top_p": 1.0 if greedy else sampling.top_p,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
        }
        tokens: list[int] = []
        rounds: Counter[int] = Counter()  # tokens committed per verification round (llamacpp-lookup)
        calls0 = draft.calls if draft else 0
        t0 = time.perf_counter()
        prefill = 0.0
        gen = llm.generate(ids, **sampler)
        for tok in gen:
            if not tokens:
                prefill = time.perf_counter() - t0
            elif draft is not None:
                rounds[draft.calls - calls0] += 1
            tokens.append(int(tok))
            if tok in self.stop_ids or len(tokens) >= max_new:
                break
        gen.close()
        wall = time.perf_counter() - t0
        accept = [rounds[k] for k in sorted(rounds)] if draft is not None else [1] * max(len(tokens) - 1, 0)
        return Run(tokens, wall, accept, prefill_s=prefill)


def build_runner(session: Any, spec: MethodSpec, cache: dict[Any, Any]) -> LlamaCppRunner:
    """The runner of ``llamacpp`` / ``llamacpp-lookup[:N]`` on the session's target GGUF (found, or assembled once
    into a temporary folder, through the same function the target's conversion uses)."""
    reason = missing()
    if reason:
        raise SpecheadError(reason)
    if session.source is None:
        raise SpecheadError("llama.cpp needs the target's GGUF: open the session with Session.open(target)")
    if ("gguf",) not in cache:
        workdir = tempfile.TemporaryDirectory(prefix="spechead-llamacpp.")
        cache[("gguf",)] = (target_gguf(session.source, Path(workdir.name)), workdir)
    gguf, workdir = cache[("gguf",)]
    runner = LlamaCppRunner(gguf, torch.get_num_threads(), session.max_len, session.stop_ids, spec.pld)
    runner.workdir = workdir
    return runner


def same_output_share(runs: list[Run], ar_runs: list[Run]) -> float:
    """The share of prompts whose tokens equal spechead AR's (every turn)."""
    pairs = list(zip(runs, ar_runs, strict=True))
    return sum(r.tokens == a.tokens for r, a in pairs) / len(pairs) if pairs else float("nan")
