"""``spechead tune`` output: the one-line summary and the ``--show`` report of everything measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spechead.tuning.result import TuneResult


def summary_line(res: TuneResult) -> str:
    if res.fallback:
        return f"tree {res.tree} ({res.reason})"
    gather = f", gather {res.gather}" if res.gather else ""
    took = res.data.get("elapsed_s")
    return f"tree {res.tree}{gather}: {res.reason}" + (f" (measured in {took:.0f} s)" if took else "")


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_show(res: TuneResult) -> str:
    """Costs, every candidate's prediction against its measurement, and why the tree was chosen."""
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
