"""``spechead bench --report DIR``: a Markdown summary and PNG plots from a bench result (its JSON).

Plots (each skipped when the run has nothing to show for it):
- ``speed_tau.png``: tokens/s and tau per category (and the MT group) per method;
- ``nu_rho.png``: the (nu, rho_tau) plane with speedup level curves rho_tau (1+kappa)/(1+nu kappa) at
  the measured kappa, one point per head method (SlimSpec's figure);
- ``vocab_evolution.png``: NanoSpec's active size and cumulative coverage over decoding rounds per
  category (NanoSpec's vocabulary-evolution figure);
- ``latency.png``: per-round milliseconds stacked by phase (drafter backbone, head, gather, verification);
- ``wmax_sweep.png``: tau and decode tokens/s against NanoSpec's W_max.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from spechead.bench.suites import MT_BENCH
from spechead.errors import SpecheadError
from spechead.heads import HEADS

PHASES = (("backbone", "drafter backbone"), ("head", "draft head"), ("gather", "gather"), ("verify", "verification"))
DPI = 90


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SpecheadError("--report needs matplotlib: pip install 'spechead[plots]'") from e
    return plt


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _categories(out: dict[str, Any]) -> list[str]:
    cats: list[str] = []
    for m in out["methods"].values():
        for c in m.get("per_category", {}):
            if c not in cats:
                cats.append(c)
    return ([c for c in cats if c != "MT"] + (["MT"] if "MT" in cats else [])) if cats else []


def nanospec_w_max(name: str) -> int | None:
    """W_max of a plain ``nanospec[:W]`` method (0 for the default), else None (other options, another head or
    another tree than the run's would confound the sweep)."""
    head, _, arg = name.partition(":")
    if "@" in name or head != "nanospec" or head not in HEADS:
        return None
    try:
        opts = HEADS[head].options(arg)
    except SpecheadError:
        return None
    if set(opts) - {"w_max"}:
        return None
    return opts.get("w_max", 0)


def plot_speed_tau(out: dict[str, Any], path: Path) -> bool:
    plt = _plt()
    cats, methods = _categories(out), list(out["methods"])
    if "MT" in cats:  # the plot shows the MT group; the report's tables keep its 8 categories
        cats = [c for c in cats if c not in MT_BENCH]
    if not cats:
        return False
    width_in = min(16, max(7, 0.2 * len(cats) * len(methods) + 3))
    fig, axes = plt.subplots(2, 1, figsize=(width_in, 6.5), sharex=True)
    width = 0.8 / len(methods)
    for j, name in enumerate(methods):
        pc = out["methods"][name]["per_category"]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(cats))]
        axes[0].bar(xs, [pc.get(c, {}).get("tokens_per_s", 0) for c in cats], width, label=name)
        taus = [pc.get(c, {}).get("tau", float("nan")) for c in cats]
        axes[1].bar(xs, [t if _finite(t) else 0 for t in taus], width, label=name)
    axes[0].set_ylabel("tokens/s (incl. prefill)")
    axes[1].set_ylabel("tau (tokens / target forward)")
    axes[1].set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0].set_title("speed and acceptance per category")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_nu_rho(out: dict[str, Any], path: Path) -> bool:
    sm = out.get("speedup_model", {})
    pts = {k: v for k, v in sm.get("methods", {}).items() if _finite(v["nu"]) and _finite(v["rho_tau"])}
    if not pts:
        return False
    import numpy as np

    plt = _plt()
    kappa = sm["kappa"].get("eagle", next(iter(sm["kappa"].values())))
    nu_max = max(1.1, *(v["nu"] * 1.1 for v in pts.values()))
    rmin = min(0.6, *(v["rho_tau"] * 0.95 for v in pts.values()))
    rmax = max(1.2, *(v["rho_tau"] * 1.05 for v in pts.values()))
    nu, rho = np.meshgrid(np.linspace(0, nu_max, 200), np.linspace(rmin, rmax, 200))
    s = rho * (1 + kappa) / (1 + nu * kappa)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    cs = ax.contour(nu, rho, s, levels=np.arange(0.5, 3.01, 0.1), cmap="viridis", linewidths=0.8)
    ax.clabel(cs, fmt="%.1fx", fontsize=7)
    for name, v in pts.items():
        ax.plot(v["nu"], v["rho_tau"], "o", color="C3")
        ax.annotate(name, (v["nu"], v["rho_tau"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.plot(1, 1, "ks")
    ax.annotate("full head", (1, 1), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.set_xlabel("nu = head time / full head time")
    ax.set_ylabel("rho_tau = tau / full head tau")
    ax.set_title(f"speedup vs full head, rho_tau (1+k)/(1+nu k) at kappa = {kappa:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_evolution(out: dict[str, Any], path: Path) -> bool:
    name = next(
        (n for n, m in out["methods"].items() if any("evolution" in c for c in m["per_category"].values())), None
    )
    if name is None:
        return False
    plt = _plt()
    pc = out["methods"][name]["per_category"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for c, cm in pc.items():
        if c in MT_BENCH and "MT" in pc:  # MT-bench categories are drawn as their group
            continue
        ev = cm.get("evolution")
        if not ev or not ev["active"]:
            continue
        x = range(1, len(ev["active"]) + 1)
        axes[0].plot(x, ev["active"], label=c)
        axes[1].plot(x, ev["coverage"], label=c)
    axes[0].set_xlabel("decoding round")
    axes[0].set_ylabel("active vocabulary size")
    axes[1].set_xlabel("decoding round")
    axes[1].set_ylabel("cumulative coverage of committed tokens")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{name}: vocabulary evolution per category (mean over prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_latency(out: dict[str, Any], path: Path) -> bool:
    rows = {n: m["round_ms"] for n, m in out["methods"].items() if m.get("round_ms") and "backbone" in m["round_ms"]}
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(rows) + 2), 4))
    bottom = [0.0] * len(rows)
    for key, label in PHASES:
        vals = [r.get(key, 0.0) for r in rows.values()]
        ax.bar(list(rows), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("ms per round")
    ax.set_xticks(range(len(rows)), list(rows), rotation=30, ha="right")
    ax.legend(fontsize=8)
    ax.set_title("per-round latency breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_wmax(out: dict[str, Any], path: Path, default_w: int = 3072) -> bool:
    sweep = []
    for name, m in out["methods"].items():
        w = nanospec_w_max(name)
        if w is not None:
            sweep.append((w or default_w, m["tau"], m.get("decode_tokens_per_s", float("nan"))))
    if len(sweep) < 2:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    sweep.sort()
    ax.plot([s[0] for s in sweep], [s[1] for s in sweep], "o-", color="C0", label="tau")
    ax.set_xscale("log", base=2)
    ax.set_xticks([s[0] for s in sweep], [str(s[0]) for s in sweep])
    ax.set_xlabel("W_max")
    ax.set_ylabel("tau", color="C0")
    ax2 = ax.twinx()
    ax2.plot([s[0] for s in sweep], [s[2] for s in sweep], "s--", color="C1")
    ax2.set_ylabel("decode tokens/s", color="C1")
    ax.set_title("NanoSpec W_max sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def _f(x: Any, fmt: str = ".2f") -> str:
    return format(x, fmt) if _finite(x) else "-"


def _header(cfg: dict[str, Any]) -> list[str]:
    """The run's title, flags and setup (prompts, machine, models, command)."""
    lines = ["# spechead bench report", ""]
    if cfg.get("note"):
        lines += [f"**{cfg['note']}**", ""]
    if cfg.get("interrupted"):
        lines += ["**Interrupted: partial results over the prompts every method finished.**", ""]
    lines += [
        f"- prompts: {cfg['prompts']} ({cfg.get('suite', '')}), max new tokens {cfg.get('max_new_tokens')}, "
        f"temperature {cfg.get('temperature')}, tree {cfg.get('tree')}"
        + (f", median of {cfg['repeats']} passes a prompt" if cfg.get("repeats", 1) > 1 else ""),
        f"- machine: {cfg.get('cpu')}, {cfg.get('threads')} threads, torch {cfg.get('torch')}, "
        f"peak RSS {_f(cfg.get('peak_rss_mb'), '.0f')} MB",
        f"- target: {cfg.get('target')}; drafters: {cfg.get('drafters')}",
    ]
    if cfg.get("command"):
        lines.append(f"- command: `{cfg['command']}`")
    if cfg.get("skipped"):
        lines.append(f"- skipped methods: {cfg['skipped']}")
    return lines


def _overall(out: dict[str, Any]) -> list[str]:
    """One row per method: speed, tau, speedups, mismatches, per-round phases and the head's set."""
    lines = [
        "",
        "## Overall",
        "",
        "| method | tok/s | decode tok/s | tau | vs ar | vs hf | mismatches vs ar | backbone ms | head ms | gather ms "
        "| verify ms | active size | coverage | head extra MB |",
        "|---|" + "---:|" * 13,
    ]
    for name, m in out["methods"].items():
        r, hs = m.get("round_ms", {}), m.get("head_stats", {})
        lines.append(
            f"| {name} | {_f(m['tokens_per_s'])} | {_f(m.get('decode_tokens_per_s'))} | {_f(m['tau'])} "
            f"| {_f(m.get('speedup_vs_ar'))} | {_f(m.get('speedup_vs_hf'))} | {m.get('mismatches_vs_ar', '-')} "
            f"| {_f(r.get('backbone'))} | {_f(r.get('head'))} | {_f(r.get('gather'))} | {_f(r.get('verify'))} "
            f"| {_f(hs.get('active_mean', hs.get('active_size')), '.0f')} | {_f(hs.get('coverage'), '.3f')} "
            f"| {_f(m['extra_bytes'] / 2**20, '.1f') if 'extra_bytes' in m else '-'} |"
        )
    return lines


def _per_category(out: dict[str, Any], cats: list[str]) -> list[str]:
    """Tokens/s, tau and (for heads with an active set) set size / coverage, per category."""
    head_row = ["| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    lines = ["", "## Tokens/s per category (speedup vs ar in parentheses)", "", *head_row]
    for name, m in out["methods"].items():
        pc = m["per_category"]
        cells = [f"{_f(pc[c]['tokens_per_s'])} ({_f(pc[c].get('speedup_vs_ar'))}x)" if c in pc else "-" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## tau per category", "", *head_row]
    for name, m in out["methods"].items():
        pc = m["per_category"]
        lines.append(f"| {name} | " + " | ".join(_f(pc[c]["tau"]) if c in pc else "-" for c in cats) + " |")
    vocab = [n for n, m in out["methods"].items() if "coverage" in m.get("head_stats", {})]
    if vocab:
        lines += ["", "## Active vocabulary per category: mean active size / coverage of committed tokens", ""]
        lines += head_row
        for name in vocab:
            pc = out["methods"][name]["per_category"]
            cells = []
            for c in cats:
                hs = pc.get(c, {}).get("head_stats", {})
                size = hs.get("active_mean", hs.get("active_size"))
                cells.append(f"{_f(size, '.0f')} / {_f(hs.get('coverage'), '.3f')}" if hs else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _speedup_model(sm: dict[str, Any]) -> list[str]:
    """The speedup model's prediction against the measured speedup, per head method."""
    kap = ", ".join(f"{k}: {_f(v, '.3f')}" for k, v in sm["kappa"].items())
    lines = [
        "",
        "## Speedup model",
        "",
        f"kappa (full head time / rest of a round) {kap}. Predicted = rho_tau (1+kappa)/(1+nu kappa); measured = "
        "pooled decode speed over the full-head run's (rho_tau x round-time ratio, a round's time being its share "
        "of the decode time). `rest` is how much the non-head part of a round moved (the model assumes 1).",
        "",
        "| method | vs | nu | rho_tau | predicted | measured | error | rest |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in sm["methods"].items():
        lines.append(
            f"| {name} | {v['reference']} | {_f(v['nu'], '.3f')} | {_f(v['rho_tau'], '.3f')} "
            f"| {_f(v['predicted'], '.3f')} | {_f(v['measured'], '.3f')} | {_f(v['error'] * 100, '+.1f')}% "
            f"| {_f(v.get('rest_ratio'), '.2f')} |"
        )
    return lines


def _projection(pj: dict[str, Any]) -> list[str]:
    """The speedups projected to Llama-3.1-8B shapes from a head-benchmark file."""
    rm = pj["round_ms"]
    lines = [
        "",
        "## Projection at Llama-3.1-8B shapes",
        "",
        f"Head times from `{pj['source']}` ({pj.get('machine')}, {pj.get('threads')} thread(s), {pj['dtype']}); "
        f"rest of a round from a roofline on the same machine figures: verification {_f(rm['verify'], '.0f')} ms, "
        f"drafter backbone {_f(rm['backbone'], '.0f')} ms, full head {_f(rm['full_head'], '.0f')} ms per round, "
        f"so kappa = {_f(pj['kappa'], '.3f')}; rho_tau and tau from this run. See docs/bench.md for the "
        "assumptions.",
        "",
        "| method | head bench entry | head ms/round | nu | rho_tau | vs full head | vs ar |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, v in pj["methods"].items():
        lines.append(
            f"| {name} | {v['headbench']} | {_f(v['head_ms_per_round'], '.1f')} | {_f(v['nu'], '.3f')} "
            f"| {_f(v['rho_tau'], '.3f')} | {_f(v['speedup_vs_full_head'], '.3f')} "
            f"| {_f(v['speedup_vs_ar'], '.3f')} |"
        )
    return lines


def markdown(out: dict[str, Any], images: list[str]) -> str:
    """The report: setup, the overall table, per-category tables, the speedup model, the projection, the plots."""
    lines = _header(out["config"]) + _overall(out)
    cats = _categories(out)
    if cats:
        lines += _per_category(out, cats)
    sm = out.get("speedup_model", {})
    if sm.get("methods"):
        lines += _speedup_model(sm)
    pj = out.get("projection_llama3.1-8b", {})
    if pj.get("methods"):
        lines += _projection(pj)
    if images:
        lines += ["", "## Plots", ""] + [f"![{Path(i).stem}]({i})" for i in images]
    return "\n".join(lines) + "\n"


def _nan(x: Any) -> Any:
    """null (a figure that does not apply, as saved in the JSON) back to NaN for plotting."""
    if x is None:
        return float("nan")
    if isinstance(x, dict):
        return {k: _nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan(v) for v in x]
    return x


def write_report(out: dict[str, Any], folder: Path) -> Path:
    """Write ``report.md`` and the plots into ``folder``; returns the Markdown file's path."""
    out = {**out, "methods": _nan(out["methods"])}
    for key in ("speedup_model", "projection_llama3.1-8b"):
        if key in out:
            out[key] = _nan(out[key])
    folder.mkdir(parents=True, exist_ok=True)
    images = []
    for fn, fname in (
        (plot_speed_tau, "speed_tau.png"),
        (plot_nu_rho, "nu_rho.png"),
        (plot_evolution, "vocab_evolution.png"),
        (plot_latency, "latency.png"),
        (plot_wmax, "wmax_sweep.png"),
    ):
        if fn(out, folder / fname):
            images.append(fname)
    path = folder / "report.md"
    path.write_text(markdown(out, images))
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m spechead.bench.report RESULT.json DIR``: re-draw a report from a saved bench JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m spechead.bench.report RESULT.json DIR", file=sys.stderr)
        return 2
    print(write_report(json.loads(Path(argv[0]).read_text()), Path(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
