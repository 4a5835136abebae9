"""Self-tuning (``spechead tune``): this machine's costs and the drafter's acceptance choose the draft tree.

``--tree auto``, the default of ``generate``, ``demo``, ``serve`` and ``bench``, is the cached tuning for
this machine + target + drafter + head + thread count, measured on first use (well under a minute for the
demo model on 2 threads, a progress bar on stderr) and cached as JSON under ``$SPECHEAD_CACHE/tune/``.
When tuning cannot run (``SPECHEAD_TUNE=off``, a context too short, an error) ``auto`` falls back to
``pipeline.DEFAULT_TREE`` and says so on stderr, once.

What is measured (medians, in ms):

- costs: a target decode step (1 row); a verification of n = 1..16 tree tokens (the target forward on n
  tokens under a tree mask, as the engine runs it); a drafter catch-up pass at 1..10 rows and a tree-level
  pass at top_k rows; every registered head's call (``heads.make_head``) at 1 row and at top_k rows; the
  AR step time (plain decoding, its glue included), which the engine's guard takes as ``ar_step_s``;
- acceptance: every candidate tree decodes a small built-in calibration set (chat, code, math,
  translation, summarization; not the benchmark's prompts) with the real engine, greedy, so only its
  acceptance matters (the output is the target's own). Prompts run as passes over the candidates; after
  two passes, all but the best (``MIN_KEEP``, and any within ``KEEP_FRAC`` of the best) are dropped, and
  no pass starts that would end past the time budget (``BUDGET_S``: the first pass always runs, with fewer
  tokens per prompt on a machine too slow for it; the next one, if need be, with the best only).

The prediction is the benchmark's cost decomposition (``bench.speedup_model``): tokens/s = tau / round,
round = rest + head, with rest = the catch-up pass (at the row counts seen) + depth x a tree-level drafter
pass + the verification (at the sizes seen, at most total_tokens + lookup) + a measured per-round
overhead (the median over candidates of the measured round time less the modelled parts), and head =
one call at 1 row + depth calls at top_k rows; with kappa = full head / rest and nu = head / full head,
tokens/s = speedup_model(kappa, nu, tau) / (rest + full head). The candidate predicting the most tokens/s
wins; if none predicts more than AR, the choice is the AR-like ``chain:1``. NanoSpec's gather mode (sync
or async) is measured on the winner both ways, interleaved, and async kept only if clearly faster.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from spechead.cache import cache_dir
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError

TUNE_VERSION = 1
AUTO_TREE_HELP = (
    "draft tree: 'auto' (default: the tree `spechead tune` measured fastest for this machine, target, drafter "
    "and head; tuned on first use, then cached), 'top_k,depth,total_tokens' or 'chain:N', optionally "
    "'+lookup:L' (a context-lookup branch of up to L tokens)"
)
SHAPES = ("chain:1", "chain:2", "chain:3", "chain:4", "2x1x4", "2x2x5", "2x3x8", "2x4x8", "4x4x16")
LOOKUPS = (0, 8)
MAX_ROWS = 16  # PrepackedLinear.KERNEL_ROWS: larger verifications leave spechead's kernel (and bitwise AR equality)
DRAFTER_ROWS = 10  # catch-up passes: the tokens a round committed (up to a full lookup branch + the bonus)
CALIBRATION = (
    ("chat", "Give me three short tips for staying focused while working from home."),
    ("code", "Write a Python function is_palindrome(s) that ignores case and spaces, with a docstring."),
    (
        "math",
        "A shop sells pens at 3 dollars each and notebooks at 5 dollars each. What do 4 pens and 2 notebooks cost?",
    ),
    ("translation", "Translate to English: Le chat dort sur le canapé pendant que nous préparons le dîner."),
    (
        "summarization",
        "Summarize in one sentence: The city council met on Tuesday to discuss the new bike lanes. Residents said the "
        "lanes made cycling safer, but shop owners worried about losing parking spaces. The council agreed to test "
        "the lanes for six months before a final vote.",
    ),
)
NEW_TOKENS = 32  # per calibration prompt
MIN_TOKENS = 12  # what a slow machine still decodes per prompt (fewer when asked for fewer)
BUDGET_S = 45.0  # no acceptance pass that would end past this many seconds of tuning; gather adds ~4 runs
MIN_PASSES = 2  # prompts every candidate decodes before any is dropped for predicting too little (budget allowing)
KEEP_FRAC = 0.95  # after MIN_PASSES, keep the MIN_KEEP best and any predicting this share of the best
MIN_KEEP = 5
AR_PROMPTS = 2
GATHER_PROMPTS = 2
GATHER_MARGIN = 0.02  # async gather must beat sync by this share of a round
OFF_VALUES = ("0", "off", "no", "false")

_MEMO: dict[str, TuneResult] = {}  # cache key -> result, this process
_FAILED: dict[tuple, TuneResult] = {}  # (target, drafter, head, threads) -> the fallback, this process
_SAID: set[str] = set()


class TuneError(SpecheadError):
    """Tuning could not run here (the ``auto`` tree then falls back to the default)."""


# -- identity and cache ---------------------------------------------------------------------------
def fingerprint() -> dict[str, Any]:
    """What makes this machine's costs this machine's: CPU, cores, torch, ISA, spechead's kernel."""
    from spechead import kernels
    from spechead.tuning.measure import cpu_name

    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        kernel_source = hashlib.sha1(kernels.SOURCE.read_bytes()).hexdigest()[:12]
    except OSError:
        kernel_source = None
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "affinity": affinity,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "SPECHEAD_ISA": os.environ.get("SPECHEAD_ISA"),
        "SPECHEAD_KERNELS": os.environ.get("SPECHEAD_KERNELS"),
        "kernel": kernels.active_isa(),  # the build in use (a failed build falls back to a narrower one)
        "kernel_source": kernel_source,
    }


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def _file_stats(path: Path) -> list[Any]:
    """(path, size, mtime) of a checkpoint's config and weight files."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(
            f for f in path.iterdir() if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name == "config.json")
        )
    else:
        return [str(path), "missing"]
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def target_identity(session) -> dict[str, Any]:
    target = session.target
    w = target.lm_head.weight
    return {
        "files": _file_stats(session.folder),
        "dtype": str(w.dtype),
        "device": str(w.device),
        "compiled": getattr(target, "_compiled_call_impl", None) is not None,
    }


def drafter_identity(drafter) -> dict[str, Any]:
    """By the checkpoint's files (``pipeline.resolve_drafter`` tags where a drafter came from), the name for a
    seeded random drafter, else a digest of its weights."""
    out: dict[str, Any] = {"arch": drafter.arch, "class": type(drafter).__name__}
    source = getattr(drafter, "spechead_source", None)
    if source is None:
        h = hashlib.sha1()
        for name, t in sorted(drafter.checkpoint_state().items()):
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out["digest"] = h.hexdigest()
    else:
        out["source"] = source
        if not source.startswith("random"):
            out["files"] = _file_stats(Path(source))
    return out


def cache_key(session, drafter, head: str, threads: int) -> tuple[str, dict[str, Any]]:
    meta = {
        "version": TUNE_VERSION,
        "machine": fingerprint(),
        "target": target_identity(session),
        "drafter": drafter_identity(drafter),
        "head": head,
        "threads": threads,
    }
    key = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return key, meta


def cache_path(key: str, head: str) -> Path:
    return cache_dir() / "tune" / f"{re.sub(r'[^A-Za-z0-9]+', '_', head).strip('_')}-{key}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _say_once(f"spechead: ignoring an unreadable tuning cache {path} ({e}); tuning again")
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _say_once(msg: str) -> None:
    if msg not in _SAID:
        _SAID.add(msg)
        print(msg, file=sys.stderr, flush=True)


# -- the result -------------------------------------------------------------------------------------
def supports_gather(head: str) -> bool:
    """Whether the head takes NanoSpec's ``gather=sync|async`` option (nanospec, hybrid)."""
    from spechead.heads import HEADS

    return "gather" in getattr(HEADS.get(head.partition(":")[0]), "STR_OPTS", ())


def with_gather(head: str, gather: str | None) -> str:
    """The head spec with a tuned gather mode, unless the spec sets one or the head has none."""
    name, _, arg = head.partition(":")
    if gather is None or not supports_gather(head) or "gather=" in arg:
        return head
    return f"{head}:gather={gather}" if arg else f"{name}:gather={gather}"


@dataclass
class TuneResult:
    tree: TreeConfig
    gather: str | None  # NanoSpec's gather mode, or None: the head's own default
    ar_step_s: float | None  # the measured AR step time (the engine guard's ``ar_step_s``)
    reason: str
    data: dict[str, Any] = field(default_factory=dict)  # everything measured (the cache file)
    path: Path | None = None
    measured: bool = False  # measured by this call (False: read from the cache)
    fallback: bool = False

    def head_spec(self, head: str) -> str:
        return with_gather(head, self.gather)

    @classmethod
    def from_data(cls, data: dict[str, Any], path: Path | None, measured: bool = False) -> TuneResult:
        choice, ar = data["choice"], data.get("ar") or {}
        step = ar.get("step_ms")
        tree, ar_step_s = TreeConfig.parse(choice["tree"]), step / 1e3 if step else None
        return cls(tree, choice.get("gather"), ar_step_s, choice["reason"], data, path, measured)


def fallback_result(why: str) -> TuneResult:
    from spechead.decoding.session import DEFAULT_TREE

    _say_once(f"spechead: --tree auto: {why}; using the default tree {DEFAULT_TREE}")
    return TuneResult(DEFAULT_TREE, None, None, f"fallback ({why})", fallback=True)


@contextlib.contextmanager
def _num_threads(threads: int | None) -> Iterator[int]:
    if threads is None:
        yield torch.get_num_threads()
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SpecheadError(f"threads must be a positive integer, got {threads!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def load_or_tune(
    session,
    drafter,
    head: str = "full",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
    **settings: Any,
) -> TuneResult:
    """The cached tuning for this machine + target + drafter + head + threads, measured now when absent (or
    ``force``). ``settings`` go to :func:`measure` (new_tokens, prompts, budget_s, shapes, lookups)."""
    head = head.strip() or "full"
    with _num_threads(threads) as n:
        key, meta = cache_key(session, drafter, head, n)
        path = cache_path(key, head)
        if not force and (res := _cached(key, path)) is not None:
            return res
        data = measure(session, drafter, head, progress=progress, **settings)
        data["key"], data["meta"] = key, meta
        res = TuneResult.from_data(data, path, measured=True)
        try:
            _write(path, data)
        except OSError as e:
            _say_once(f"spechead: could not cache the tuning in {path}: {e}")
            res.path = None
        _MEMO[key] = res
        return res


def _cached(key: str, path: Path) -> TuneResult | None:
    if key in _MEMO:
        return _MEMO[key]
    data = _read(path)
    if data is not None and data.get("key") == key and "choice" in data:
        try:
            res = _MEMO[key] = TuneResult.from_data(data, path)
            return res
        except (KeyError, TypeError, ValueError) as e:
            _say_once(f"spechead: ignoring a malformed tuning cache {path} ({e}); tuning again")
    return None


def cached(session, drafter, head: str = "full", threads: int | None = None) -> TuneResult | None:
    """The cached tuning if there is one; never measures (the server's other heads, which must not stall
    the requests behind them for a minute of tuning)."""
    head = head.strip() or "full"
    with _num_threads(threads) as n:
        key, _ = cache_key(session, drafter, head, n)
        return _cached(key, cache_path(key, head))


def resolve(session, drafter, head: str = "full", threads: int | None = None, progress: bool = True) -> TuneResult:
    """What ``--tree auto`` means: the cached tuning, tuning now if absent; the default tree (said once on
    stderr) if tuning cannot run. A bad head spec is still the user's error (SpecheadError)."""
    if os.environ.get("SPECHEAD_TUNE", "").strip().lower() in OFF_VALUES:
        return fallback_result("tuning disabled by SPECHEAD_TUNE")
    failed = (id(session.target), id(drafter), head, threads or torch.get_num_threads())
    if failed in _FAILED:  # failed once in this process: not again for every decoder
        return _FAILED[failed]
    try:
        res = load_or_tune(session, drafter, head, threads, progress=progress)
    except TuneError as e:
        res = _FAILED[failed] = fallback_result(str(e))
    except SpecheadError:
        raise
    except Exception as e:  # a failed measurement must not stop decoding
        res = _FAILED[failed] = fallback_result(f"tuning failed ({type(e).__name__}: {e})")
    if res.measured and progress:
        _say_once(f"spechead: --tree auto: {summary_line(res)}" + (f"; cached in {res.path}" if res.path else ""))
    return res


def resolve_tree(session, drafter, head: str = "full", threads: int | None = None) -> TreeConfig:
    return resolve(session, drafter, head, threads).tree


# -- measuring --------------------------------------------------------------------------------------
def candidate_grid(shapes=SHAPES, lookups=LOOKUPS, max_rows: int = MAX_ROWS) -> list[TreeConfig]:
    out: list[TreeConfig] = []
    for shape in shapes:
        for lookup in lookups:
            t = TreeConfig.parse(shape + (f"+lookup:{lookup}" if lookup else ""))
            if t.max_rows <= max_rows and t not in out:
                out.append(t)
    if not out:
        raise SpecheadError(f"no candidate tree verifies at most {max_rows} tokens")
    return out


def calibration_prompts(session, n: int) -> list[tuple[str, list[int]]]:
    """The built-in prompts, chat-encoded; a session without a tokenizer (tests) gets their bytes as ids."""
    out = []
    vocab = session.target.config.vocab_size
    for kind, text in CALIBRATION[:n]:
        if getattr(session, "tokenizer", None) is None:
            ids = [b % vocab for b in text.encode()][:48]
        else:
            ids = list(session.encode(text))
        out.append((kind, ids))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    from spechead.tuning.measure import median_ms

    def run() -> None:
        fn()
        _sync(device)

    return median_ms(run, repeats)


def _packs(target) -> dict[int, set[int]]:
    from spechead.model.layers import PrepackedLinear

    return {id(m): set(m.packed) for m in target.modules() if isinstance(m, PrepackedLinear) and hasattr(m, "packed")}


def _drop_new_packs(target, before: dict[int, set[int]]) -> None:
    """Forget MKL weight packings made for other row counts while tuning (each is a copy of the weights)."""
    from spechead.model.layers import PrepackedLinear

    for m in target.modules():
        if isinstance(m, PrepackedLinear) and hasattr(m, "packed"):
            keep = before.get(id(m), set())
            for rows in [r for r in m.packed if r not in keep]:
                del m.packed[rows]


class _Recorder:
    """Row counts of the target's verifications and the drafter's catch-up passes (forward pre-hooks)."""

    def __init__(self, target, drafter) -> None:
        self.verify: list[int] = []
        self.backbone: list[int] = []
        self.hooks = [
            target.register_forward_pre_hook(self._target, with_kwargs=True),
            drafter.register_forward_pre_hook(self._drafter, with_kwargs=True),
        ]

    def _target(self, module, args, kwargs) -> None:
        if kwargs.get("mask") is not None:
            self.verify.append(int(args[0].shape[0]))

    def _drafter(self, module, args, kwargs) -> None:
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if mask is None:
            self.backbone.append(int(args[0].shape[0]))

    def take(self) -> tuple[list[int], list[int]]:
        out = self.verify, self.backbone[1:]  # the first catch-up pass covers the prompt: a per-request cost
        self.verify, self.backbone = [], []
        return out

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.inference_mode()
def measure_costs(session, drafter, head_specs: list[str], ks: list[int], ids: list[int], tick) -> dict[str, Any]:
    """Median ms of the parts of a round, on a prefix of the first calibration prompt."""
    target = session.target
    dev = target.lm_head.weight.device
    want_aux = drafter.arch == "eagle3"
    x = torch.tensor(ids, dtype=torch.long, device=dev)
    p = x.numel()
    drafter.setup_cache(session.max_len + 64)
    before = _packs(target)
    target.prepack(1)
    pre = target(x, 0, want_aux=want_aux)
    feats = drafter.target_features(pre)
    costs: dict[str, Any] = {"prefix": p}

    def cyc(t, n):  # n rows of t, cycling when it has fewer
        return t[torch.arange(n, device=dev) % t.shape[0]]

    def seen(rows: int, cached: int, nodes: Tensor) -> Tensor:  # a node sees the cache and its tree ancestors
        return torch.cat([torch.ones(rows, cached, dtype=torch.bool, device=dev), nodes], dim=1)

    one = x[-1:]
    costs["target_step_ms"] = _median_ms(lambda: target(one, p).logits.argmax(-1), 5, dev)
    tick("target step")
    costs["verify_ms"] = {}
    for n in range(1, MAX_ROWS + 1):
        target.prepack(n)
        toks = cyc(x, n)
        mask = seen(n, p, torch.ones(n, n, dtype=torch.bool, device=dev).tril())  # a chain: its ancestors
        pos = torch.arange(p, p + n, device=dev)

        def verify(toks=toks, mask=mask, pos=pos):
            return target(toks, p, positions=pos, mask=mask, want_aux=want_aux).logits.argmax(-1)

        costs["verify_ms"][n] = _median_ms(verify, 3, dev)
        _drop_new_packs(target, before)
        tick(f"verify {n}")
    costs["drafter_ms"] = {}
    for n in range(1, DRAFTER_ROWS + 1):
        toks, f, pos = cyc(x, n), cyc(feats, n), torch.arange(p, p + n, device=dev)
        costs["drafter_ms"][n] = _median_ms(lambda toks=toks, f=f, pos=pos: drafter(toks, f, p, pos, None), 5, dev)
    tick("drafter")
    h_last = drafter(one, feats[-1:], p, torch.tensor([p], device=dev), None)[-1:]
    costs["drafter_tree_ms"] = {}
    for k in ks:
        toks, hk = cyc(x, k), h_last.expand(k, -1)
        mask = seen(k, p + 1, torch.eye(k, dtype=torch.bool, device=dev))  # one tree level
        pos = torch.full((k,), p + 1, dtype=torch.long, device=dev)
        costs["drafter_tree_ms"][k] = _median_ms(
            lambda toks=toks, hk=hk, mask=mask, pos=pos: drafter(toks, hk, p + 1, pos, mask), 5, dev
        )
    hin = drafter.head_input(h_last)
    costs["heads"] = {}
    for spec in head_specs:
        entry: dict[str, Any] = {}
        head = None
        try:
            head = session.draft_head(drafter, spec)
            head.begin(x, pre.logits if head.needs_prompt_logits else None)
            entry["class"] = type(head).__name__
            for k in ks:
                root = _median_ms(lambda k=k, head=head: head.topk(hin, k), 5, dev)
                hk = hin.expand(k, -1).contiguous()
                level = root if k == 1 else _median_ms(lambda k=k, hk=hk, head=head: head.topk(hk, k), 5, dev)
                entry[k] = {"root": root, "level": level}
        except (SpecheadError, RuntimeError, ValueError) as e:  # a head this drafter or vocabulary cannot build
            entry = {"error": f"{type(e).__name__}: {e}"}
        costs["heads"][spec] = entry
        head = None  # free it before building the next
        tick(f"head {spec}")
    return costs


def _decode(dec, rec: _Recorder, ids: list[int], new_tokens: int, speculative: bool = True) -> dict[str, Any]:
    res = dec.generate(ids, new_tokens, speculative=speculative)
    verify, backbone = rec.take()
    return {
        "tokens": res.tokens,
        "rounds": len(res.accept_lengths),
        "accepted": sum(res.accept_lengths),
        "decode_s": res.wall_s - res.prefill_s,
        "wall_s": res.wall_s,
        "verify_rows": verify,
        "backbone_rows": backbone,
        "head_ms": res.timers_ms.get("head", 0.0),
        "gather_ms": res.timers_ms.get("gather", 0.0),
    }


def _new_candidate(tree: TreeConfig) -> dict[str, Any]:
    sums = dict.fromkeys(("prompts", "rounds", "accepted"), 0) | dict.fromkeys(
        ("decode_s", "wall_s", "head_ms", "gather_ms"), 0.0
    )
    lists = {"verify_rows": [], "backbone_rows": [], "outputs": []}
    return {"tree": str(tree), "max_rows": tree.max_rows, **sums, **lists, "dropped_after": None}


def _per_round(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> float:
    return scale * sum(r[key] for r in runs) / max(sum(r["rounds"] for r in runs), 1)


def _add(cand: dict[str, Any], run: dict[str, Any]) -> None:
    cand["prompts"] += 1
    for k in ("rounds", "accepted", "decode_s", "wall_s", "head_ms", "gather_ms"):
        cand[k] += run[k]
    cand["verify_rows"] += run["verify_rows"]
    cand["backbone_rows"] += run["backbone_rows"]
    cand["outputs"].append(run["tokens"])


def _table(costs: dict[str, Any], key: str) -> dict[int, float]:
    return {int(k): v for k, v in costs[key].items()}


def _head_round(costs: dict[str, Any], spec: str, tree: TreeConfig) -> float | None:
    entry = costs["heads"].get(spec) or {}
    per_k = entry.get(tree.top_k, entry.get(str(tree.top_k)))
    if not per_k:
        return None
    return per_k["root"] + tree.depth * per_k["level"]  # draft_tree: the root at 1 row, each level at top_k


def parts(cand: dict[str, Any], costs: dict[str, Any], head: str) -> dict[str, float]:
    """The modelled parts of one round (ms) of a candidate that has decoded (its row counts observed)."""
    tree = TreeConfig.parse(cand["tree"])
    verify, drafter, tree_ms = _table(costs, "verify_ms"), _table(costs, "drafter_ms"), _table(costs, "drafter_tree_ms")
    bb_rows = cand["backbone_rows"] or [1]
    v_rows = cand["verify_rows"] or [tree.total_tokens]
    out = {
        "backbone": statistics.mean(drafter[min(max(r, 1), DRAFTER_ROWS)] for r in bb_rows),
        "drafter": tree.depth * tree_ms[tree.top_k],
        "verify": statistics.mean(verify[min(max(r, 1), MAX_ROWS)] for r in v_rows),
    }
    h = _head_round(costs, head, tree)
    out["head"] = h if h is not None else cand["head_ms"] / max(cand["rounds"], 1)
    full = _head_round(costs, "full", tree)
    out["full_head"] = full if full is not None else out["head"]
    return out


def predict(cand: dict[str, Any], costs: dict[str, Any], head: str, overhead_ms: float) -> dict[str, Any]:
    """The benchmark's speedup model on this machine's costs: rest = catch-up + tree passes + verify + overhead,
    kappa = full head / rest, nu = head / full head, tokens/s = speedup_model(kappa, nu, tau) / (rest + full)."""
    from spechead.tuning.speedup import speedup_model

    p = parts(cand, costs, head)
    rest = max(p["backbone"] + p["drafter"] + p["verify"] + overhead_ms, 1e-6)
    kappa, nu = p["full_head"] / rest, p["head"] / p["full_head"] if p["full_head"] > 0 else 1.0
    tau = cand["accepted"] / cand["rounds"] if cand["rounds"] else 1.0
    return {
        "parts_ms": p,
        "kappa": kappa,
        "nu": nu,
        "predicted_round_ms": rest + p["head"],
        "predicted_tok_s": 1e3 * speedup_model(kappa, nu, tau) / (rest + p["full_head"]),
    }


def _residual(cand: dict[str, Any], costs: dict[str, Any], head: str) -> float:
    p = parts(cand, costs, head)
    return 1e3 * cand["decode_s"] / cand["rounds"] - (p["backbone"] + p["drafter"] + p["verify"] + p["head"])


def _overhead(cands: list[dict[str, Any]], costs: dict[str, Any], head: str) -> float:
    res = [_residual(c, costs, head) for c in cands if c["rounds"]]
    return statistics.median(res) if res else 0.0


def _pace(cands: list[dict[str, Any]]) -> float:
    """Seconds one more prompt takes these candidates, at their pace so far."""
    return sum(c["wall_s"] / c["prompts"] for c in cands if c["prompts"])


def _prune(cands, passes: int, left: int, bar, frac: float = KEEP_FRAC) -> None:
    live = [c for c in cands if c["dropped_after"] is None and c["rounds"]]
    ranked = sorted(live, key=lambda c: c["pred"]["predicted_tok_s"], reverse=True)
    if not ranked:
        return
    best = ranked[0]["pred"]["predicted_tok_s"]
    for c in ranked[MIN_KEEP:]:  # the best MIN_KEEP stay, and any within frac of the best
        if c["pred"]["predicted_tok_s"] < frac * best:
            c["dropped_after"] = passes
            bar.total -= left
    bar.refresh()


def measure(
    session,
    drafter,
    head: str = "full",
    progress: bool = True,
    new_tokens: int = NEW_TOKENS,
    prompts: int = len(CALIBRATION),
    budget_s: float = BUDGET_S,
    shapes=SHAPES,
    lookups=LOOKUPS,
) -> dict[str, Any]:
    """Measure and choose (see the module docstring). Returns the JSON-able record that gets cached."""
    from spechead.heads import HEADS

    if new_tokens < 4 or prompts < 1 or not budget_s > 0:
        got = f"got {new_tokens}, {prompts} and {budget_s}"
        raise SpecheadError(f"tuning needs new_tokens >= 4, prompts >= 1 and budget_s > 0 ({got})")
    main_head = session.draft_head(drafter, head)  # a bad head spec is the user's error, raised as such
    specs = sorted(HEADS) + ([head] if head not in HEADS else [])
    try:
        grid = candidate_grid(shapes, lookups)
        return _measure(session, drafter, head, main_head, specs, grid, progress, new_tokens, prompts, budget_s)
    except SpecheadError as e:
        if isinstance(e, TuneError):
            raise
        raise TuneError(f"cannot tune: {e}") from e


@torch.inference_mode()
def _measure(session, drafter, head, main_head, specs, grid, progress, new_tokens, n_prompts, budget_s):
    from spechead.decoding.decoder import Decoder

    t0 = time.perf_counter()
    prompts = calibration_prompts(session, n_prompts)
    longest = max(len(ids) for _, ids in prompts)
    if longest + new_tokens + 2 * MAX_ROWS + 8 > session.max_len:
        raise TuneError(f"the context of {session.max_len} tokens is too short for the calibration prompts")
    try:
        stop_ids = list(session.stop_ids)
    except Exception:  # a session without a tokenizer
        stop_ids = []
    target, max_len = session.target, session.max_len
    ks = sorted({1} | {t.top_k for t in grid})
    gather = supports_gather(head) and "gather=" not in head.partition(":")[2]
    steps = 1 + MAX_ROWS + 1 + len(specs) + min(AR_PROMPTS, len(prompts)) + len(grid) * len(prompts)
    steps += 2 * min(GATHER_PROMPTS, len(prompts)) if gather else 0
    bar = tqdm(total=steps, desc="tune", unit="step", file=sys.stderr, disable=not progress, leave=False)
    rec = _Recorder(target, drafter)
    before, drafter_len = _packs(target), drafter.max_len
    try:

        def tick(what: str) -> None:
            bar.set_postfix_str(what, refresh=False)
            bar.update(1)

        costs = measure_costs(session, drafter, specs, ks, prompts[0][1], tick)
        # the AR step (the guard's reference; AR's tokens are the calibration outputs' reference too)
        ar_dec = Decoder(target, None, None, None, max_len, stop_ids)
        ar_runs = []
        for kind, ids in prompts[:AR_PROMPTS]:
            bar.set_postfix_str(f"ar {kind}", refresh=False)
            ar_runs.append(_decode(ar_dec, rec, ids, new_tokens, speculative=False))
            bar.update(1)
        ar_tokens = sum(max(len(r["tokens"]) - 1, 0) for r in ar_runs)
        ar_step_ms = 1e3 * sum(r["decode_s"] for r in ar_runs) / max(ar_tokens, 1)
        del ar_dec
        # acceptance: the real engine, every candidate, prompt by prompt
        cands = [_new_candidate(t) for t in grid]
        current: dict[str, Any] = {}

        def make_decoder(c: dict[str, Any], head_obj=main_head):
            tree = TreeConfig.parse(c["tree"])
            if current.get("rows") != tree.max_rows:
                current.clear()
                _drop_new_packs(target, before)
            if current.get("tree") != tree or current.get("head") is not head_obj:
                current.update(tree=tree, head=head_obj, rows=tree.max_rows)
                current["dec"] = Decoder(target, drafter, head_obj, tree, max_len, stop_ids)
            return current["dec"]

        def refresh() -> float:
            overhead = _overhead([c for c in cands if c["rounds"]], costs, head)
            for c in cands:
                if c["rounds"]:
                    c["pred"] = predict(c, costs, head, overhead)
            return overhead

        # a slow machine decodes fewer tokens per prompt: a first pass over every candidate (each at about AR's
        # pace or faster) should take at most half the budget
        fit = int(0.5 * budget_s / (len(grid) * ar_step_ms / 1e3))
        new_tokens = max(min(new_tokens, MIN_TOKENS), min(new_tokens, fit))

        def live() -> list[dict[str, Any]]:  # by verification size: consecutive decoders share a weight layout
            return sorted((c for c in cands if c["dropped_after"] is None), key=lambda c: c["max_rows"])

        passes = 0
        for i, (kind, ids) in enumerate(prompts):
            if i:  # another pass only if it fits the budget, at these candidates' pace so far
                if time.perf_counter() - t0 + _pace(live()) > budget_s:
                    _prune(cands, i, len(prompts) - i, bar, frac=float("inf"))  # the MIN_KEEP best, if that fits
                if time.perf_counter() - t0 + _pace(live()) > budget_s:
                    bar.total -= (len(prompts) - i) * len(live())
                    break
            for c in live():
                bar.set_postfix_str(f"{kind} {c['tree']}", refresh=False)
                _add(c, _decode(make_decoder(c), rec, ids, new_tokens))
                bar.update(1)
            passes, left = i + 1, len(prompts) - i - 1
            refresh()
            if passes >= MIN_PASSES and left:
                _prune(cands, passes, left, bar)
        overhead = refresh()
        # the reference output per prompt: AR's where it ran, else the candidates' majority
        for j in range(passes):
            outs = [tuple(c["outputs"][j]) for c in cands if len(c["outputs"]) > j]
            ref = tuple(ar_runs[j]["tokens"][:new_tokens]) if j < len(ar_runs) else statistics.mode(outs)
            for c in cands:
                if len(c["outputs"]) > j and tuple(c["outputs"][j]) != ref:
                    c["mismatches"] = c.get("mismatches", 0) + 1
        ar_tok_s = 1e3 / ar_step_ms
        ok = [c for c in cands if c["dropped_after"] is None and c["rounds"] and not c.get("mismatches")]
        if not ok:
            raise TuneError("no candidate tree decoded the calibration prompts exactly")
        ok.sort(key=lambda c: c["pred"]["predicted_tok_s"], reverse=True)
        best = ok[0]
        pred = best["pred"]["predicted_tok_s"]
        if pred > ar_tok_s:
            chosen = best["tree"]
            runner = f"; next {ok[1]['tree']} {ok[1]['pred']['predicted_tok_s']:.1f}" if len(ok) > 1 else ""
            reason = (
                f"highest predicted speed: {pred:.1f} tok/s = {pred / ar_tok_s:.2f}x AR ({ar_tok_s:.1f} tok/s), "
                f"tau {best['accepted'] / best['rounds']:.2f}{runner}"
            )
        else:
            chosen = str(TreeConfig.chain(1))
            pred = next((c["pred"]["predicted_tok_s"] for c in cands if c["tree"] == chosen and "pred" in c), None)
            reason = (
                f"no tree beats AR by the prediction (best {best['tree']} {best['pred']['predicted_tok_s']:.1f} "
                f"tok/s vs AR {ar_tok_s:.1f} tok/s): the AR-like chain:1, the cheapest speculation"
            )
        # NanoSpec's gather: the chosen tree both ways, interleaved prompt by prompt
        gather_rec = None
        gather_choice = None
        if gather:
            heads = {m: session.draft_head(drafter, with_gather(head, m)) for m in ("sync", "async")}
            runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
            tree_c = {"tree": chosen}
            for kind, ids in prompts[:GATHER_PROMPTS]:
                for mode, h in heads.items():
                    bar.set_postfix_str(f"gather={mode} {kind}", refresh=False)
                    runs[mode].append(_decode(make_decoder(tree_c, h), rec, ids, new_tokens))
                    bar.update(1)
            per = {m: _per_round(rs, "decode_s", 1e3) for m, rs in runs.items()}
            gather_choice = "async" if per["async"] < (1 - GATHER_MARGIN) * per["sync"] else "sync"
            gather_rec = {
                "sync_round_ms": per["sync"],
                "async_round_ms": per["async"],
                "sync_gather_ms": _per_round(runs["sync"], "gather_ms"),
                "prompts": len(runs["sync"]),
                "choice": gather_choice,
            }
            reason += f"; gather {gather_choice} ({per['sync']:.2f} ms/round sync, {per['async']:.2f} async)"
        current.clear()
        out_cands = []
        for c in cands:
            row = {k: v for k, v in c.items() if k not in ("outputs", "verify_rows", "backbone_rows", "pred")}
            row["tau"] = c["accepted"] / c["rounds"] if c["rounds"] else None
            row["verify_rows_mean"] = statistics.mean(c["verify_rows"]) if c["verify_rows"] else None
            row["backbone_rows_mean"] = statistics.mean(c["backbone_rows"]) if c["backbone_rows"] else None
            row["measured_round_ms"] = 1e3 * c["decode_s"] / c["rounds"] if c["rounds"] else None
            row["measured_tok_s"] = c["accepted"] / c["decode_s"] if c["decode_s"] > 0 else None
            row.update(c.get("pred", {}))
            out_cands.append(row)
        return {
            "version": TUNE_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "elapsed_s": time.perf_counter() - t0,
            "head": head,
            "threads": torch.get_num_threads(),
            "settings": {
                "new_tokens": new_tokens,
                "prompts": [kind for kind, _ in prompts],
                "passes": passes,
                "budget_s": budget_s,
                "grid": [str(t) for t in grid],
            },
            "costs": costs,
            "ar": {"step_ms": ar_step_ms, "tok_s": ar_tok_s, "prompts": len(ar_runs)},
            "overhead_ms": overhead,
            "candidates": out_cands,
            "gather": gather_rec,
            "choice": {"tree": chosen, "gather": gather_choice, "reason": reason, "predicted_tok_s": pred},
        }
    finally:
        rec.close()
        bar.close()
        _drop_new_packs(target, before)
        if drafter_len:  # the tuning's decoders resized the drafter's cache: back to what its decoders expect
            drafter.setup_cache(drafter_len)


# -- showing ----------------------------------------------------------------------------------------
def summary_line(res: TuneResult) -> str:
    if res.fallback:
        return f"tree {res.tree} ({res.reason})"
    gather = f", gather {res.gather}" if res.gather else ""
    took = res.data.get("elapsed_s")
    return f"tree {res.tree}{gather}: {res.reason}" + (f" (measured in {took:.0f} s)" if took else "")


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_show(res: TuneResult) -> str:
    d = res.data
    if not d:
        return summary_line(res)
    meta, costs = d.get("meta", {}), d["costs"]
    kinds, passes = d["settings"]["prompts"], d["settings"]["passes"]
    m = meta.get("machine", {})
    lines = [
        f"tuning {res.path or '(not cached)'}",
        f"machine: {m.get('cpu')} ({m.get('cores')} cores, torch {m.get('torch')}, {m.get('capability')}, "
        f"kernel {m.get('kernel') or 'off'}, SPECHEAD_ISA={m.get('SPECHEAD_ISA') or '-'}, "
        f"SPECHEAD_KERNELS={m.get('SPECHEAD_KERNELS') or '-'}); {d.get('threads')} threads",
        f"target: {_where(meta.get('target', {}))}; drafter: {_where(meta.get('drafter', {}))}; head: {d.get('head')}",
        f"measured {d.get('created')} in {d.get('elapsed_s', 0):.1f} s; acceptance over {passes} of the "
        f"{len(kinds)} calibration prompts ({', '.join(kinds[:passes])}), {d['settings']['new_tokens']} tokens each",
        "",
        f"costs, median ms (prefix of {costs.get('prefix')} tokens):",
        f"  target decode step (1 row) {costs['target_step_ms']:.2f}; AR decoding {d['ar']['step_ms']:.2f} ms/token "
        f"= {d['ar']['tok_s']:.1f} tok/s",
        "  verify, rows: " + "  ".join(f"{k}:{v:.2f}" for k, v in costs["verify_ms"].items()),
        "  drafter catch-up pass, rows: " + "  ".join(f"{k}:{v:.2f}" for k, v in costs["drafter_ms"].items()),
        "  drafter tree pass, top_k rows: " + "  ".join(f"{k}:{v:.2f}" for k, v in costs["drafter_tree_ms"].items()),
        "  head calls, top_k: root (1 row) / level (top_k rows):",
    ]
    for spec, e in costs["heads"].items():
        if "error" in e:
            lines.append(f"    {spec:<12} unavailable: {e['error']}")
        else:
            cells = "  ".join(f"k={k}: {v['root']:.3f}/{v['level']:.3f}" for k, v in e.items() if k != "class")
            lines.append(f"    {spec:<12} {cells}  ({e.get('class')})")
    lines += [
        f"  per-round overhead (median of measured round - modelled parts): {d['overhead_ms']:.2f}",
        "",
        "candidates: tau measured by decoding; round = catch-up + depth x tree pass + verify + overhead + head",
        f"  {'tree':<16}{'prompts':>8}{'tau':>6}{'rows':>6}{'kappa':>7}{'nu':>6}{'round ms':>14}{'tok/s':>14}"
        f"{'vs AR':>7}  note",
        f"  {'':<16}{'':>8}{'':>6}{'':>6}{'':>7}{'':>6}{'pred / meas':>14}{'pred / meas':>14}",
    ]
    ar = d["ar"]["tok_s"]
    for c in sorted(d["candidates"], key=lambda c: -(c.get("predicted_tok_s") or 0)):
        note = []
        if c["tree"] == d["choice"]["tree"]:
            note.append("<- chosen")
        if c.get("dropped_after"):
            note.append(f"dropped after {c['dropped_after']} prompts")
        if c.get("mismatches"):
            note.append(f"{c['mismatches']} outputs differ from AR: excluded")
        pt = c.get("predicted_tok_s")
        lines.append(
            f"  {c['tree']:<16}{c['prompts']:>8}{_fmt(c.get('tau')):>6}{_fmt(c.get('verify_rows_mean'), '.1f'):>6}"
            f"{_fmt(c.get('kappa'), '.3f'):>7}{_fmt(c.get('nu'), '.2f'):>6}"
            f"{_fmt(c.get('predicted_round_ms'), '.1f'):>7} /{_fmt(c.get('measured_round_ms'), '.1f'):>5}"
            f"{_fmt(pt, '.1f'):>8} /{_fmt(c.get('measured_tok_s'), '.1f'):>5}"
            f"{_fmt(pt / ar if pt else None):>7}  {', '.join(note)}"
        )
    g = d.get("gather")
    if g:
        lines.append(
            f"\ngather: sync {g['sync_round_ms']:.2f} ms/round (gather itself {g['sync_gather_ms']:.3f}), async "
            f"{g['async_round_ms']:.2f}, over {g['prompts']} prompts -> {g['choice']}"
        )
    lines.append(f"\nchosen: {summary_line(res)}")
    return "\n".join(lines)


def _where(ident: dict[str, Any]) -> str:
    if ident.get("source"):
        return ident["source"]
    files = ident.get("files") or []
    if files and isinstance(files[0], list):
        return str(Path(files[0][0]).parent)
    return ident.get("digest", "?")[:12] if ident.get("digest") else "?"


# -- command line -----------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def cmd_tune(args: argparse.Namespace) -> int:
    from spechead.decoding.session import Session, resolve_drafter

    if args.budget is not None and not args.budget > 0:
        raise SpecheadError(f"--budget must be > 0 seconds, got {args.budget}")
    session = Session.open(args.target, args.max_len)
    drafter = resolve_drafter(args.drafter, session.target, args.arch)
    settings = {"budget_s": args.budget} if args.budget is not None else {}
    t0 = time.perf_counter()
    res = load_or_tune(session, drafter, args.head, force=args.force, progress=not args.quiet, **settings)
    if args.show:
        print(format_show(res))
    else:
        how = f"measured in {time.perf_counter() - t0:.1f} s" if res.measured else "cached"
        print(f"{summary_line(res)}\n{how}: {res.path}")
    return 0


def add_cli(sub) -> None:
    t = sub.add_parser("tune", help="measure this machine's costs and the drafter's acceptance; pick the tree")
    t.add_argument("--target", default="demo", help="demo, a HF model folder or a .gguf file")
    t.add_argument("--drafter", default="demo", help="demo, random or a drafter folder")
    t.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"], help="drafter kind for demo/random")
    t.add_argument("--head", default="full", help="draft head to tune for, e.g. full, nanospec, lowrank")
    t.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: all cores)")
    t.add_argument("--max-len", type=int, default=4096, help="context limit (KV cache size)")
    t.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"no acceptance pass ends past this many seconds of tuning (default {BUDGET_S:g})",
    )
    t.add_argument("--show", action="store_true", help="print every measurement and why the tree was chosen")
    t.add_argument("--force", action="store_true", help="measure again even if a tuning is cached")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_tune)
