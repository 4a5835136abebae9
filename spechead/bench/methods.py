"""The benchmark's method grammar: ``hf``, ``hf-pld[:N]``, ``llamacpp``, ``llamacpp-lookup[:N]``, ``ar``, ``eagle``,
``eagle3``, ``lowrank[:R]``, any head spec, each with an optional ``@TREE``, and presets. Parsed before any model
loads, so a typo fails fast."""

from __future__ import annotations

from dataclasses import dataclass

from spechead.decoding.session import AUTO_TREE
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError

PRESETS = {
    "main": "hf,hf-pld,ar,eagle,fr:8192,vocabtrim:8192,nanospec,hybrid,eagle3,lowrank",
    "sweep": "nanospec:512,nanospec:1024,nanospec:2048,nanospec:4096",
}


@dataclass
class MethodSpec:
    """``hf``, ``hf-pld[:N]``, ``llamacpp`` (llama.cpp's own decoding of the target's GGUF), ``llamacpp-lookup[:N]``
    (its prompt-lookup speculative decoding, N drafted tokens), ``ar``, ``eagle`` (full head), ``eagle3`` (the
    EAGLE-3 drafter, full head), ``lowrank[:R]`` (the low-rank drafter), or any head spec (``fr:N``,
    ``nanospec:W``, ``hybrid``...) on the EAGLE-2 drafter; ``@TREE`` overrides the draft tree."""

    name: str
    kind: str  # hf | pld | llamacpp | ar | spec
    head: str = "full"
    tree: TreeConfig | None = None
    drafter: str = "eagle2"  # eagle2 | eagle3 | lowrank
    pld: int = 10  # tokens a prompt-lookup round drafts (hf-pld, llamacpp-lookup); 0 for plain llamacpp
    twin: str | None = None  # set once drafters load: the family whose drafter ``lowrank`` turned out to decode

    @classmethod
    def parse(cls, spec: str, default_tree: TreeConfig | None) -> MethodSpec:
        """``default_tree`` None (or ``@auto``): the tree is the tuning for the method's drafter and head,
        resolved when its runner is built (``build_runners``)."""
        base, _, tree = spec.partition("@")
        t = TreeConfig.parse(tree) if tree and tree.strip() != AUTO_TREE else None if tree else default_tree
        name, _, arg = base.partition(":")
        if base in ("hf", "ar"):
            return cls(spec, base)
        if name == "hf-pld":
            if arg and not (arg.isdigit() and int(arg) > 0):
                raise SpecheadError(f"hf-pld:N needs a positive integer, got {arg!r}")
            return cls(spec, "pld", pld=int(arg) if arg else 10)
        if base == "llamacpp":
            return cls(spec, "llamacpp", pld=0)
        if name == "llamacpp-lookup":
            if arg and not (arg.isdigit() and int(arg) > 0):
                raise SpecheadError(f"llamacpp-lookup:N needs a positive integer, got {arg!r}")
            return cls(spec, "llamacpp", pld=int(arg) if arg else 10)
        if base == "eagle":
            return cls(spec, "spec", "full", t)
        if base == "eagle3":
            return cls(spec, "spec", "full", t, "eagle3")
        if name == "lowrank":
            return cls(spec, "spec", base, t, "lowrank")
        return cls(spec, "spec", base, t)

    @property
    def family(self) -> str:
        """The drafter whose full head this method is compared with: the low-rank drafter is EAGLE-3's twin,
        unless it is the EAGLE-2 drafter itself with a fitted low-rank head (``twin``)."""
        if self.twin is not None:
            return self.twin
        return "eagle3" if self.drafter in ("eagle3", "lowrank") else "eagle2"

    def reference(self, specs: list[MethodSpec]) -> MethodSpec | None:
        """The full-head run of the same drafter family on the same tree, which the speedup model compares
        this method with (a method on another tree has another rest of the round)."""
        same = (r for r in specs if r.kind == "spec" and r.family == self.family and r.tree == self.tree)
        return next((r for r in same if r.head == "full"), None)


def check_methods(methods: list[str], tree: TreeConfig | None) -> list[MethodSpec]:
    """Parse every method before any model loads; an unknown name is a typo, not a method to skip."""
    from spechead.heads import HEADS
    from spechead.heads.base import check_head_spec

    specs = [MethodSpec.parse(m, tree) for m in methods]
    for s in (s for s in specs if s.kind == "spec"):
        if s.head.partition(":")[0] not in HEADS:
            known = "hf, hf-pld, llamacpp, llamacpp-lookup, ar, eagle, eagle3, " + ", ".join(sorted(HEADS))
            raise SpecheadError(f"unknown method {s.name!r}; known: {known}, presets {', '.join(PRESETS)}")
        try:  # its options too (nanospec:abc, fr:0): refused, not skipped after the model loads
            check_head_spec(s.head)
        except (SpecheadError, ValueError) as e:
            raise SpecheadError(f"method {s.name!r}: {e}") from None
    if len({s.name for s in specs}) != len(specs):
        raise SpecheadError("duplicate method names")
    return specs


def expand_methods(text: str) -> list[str]:
    """Method names with presets expanded; a method a preset repeats runs once, a name given twice is an error."""
    out: list[str] = []
    given = [m.strip() for m in text.split(",") if m.strip()]
    for m in given:
        if m not in PRESETS and given.count(m) > 1:
            raise SpecheadError(f"duplicate method {m!r}")
        for x in PRESETS[m].split(",") if m in PRESETS else [m]:
            if x not in out:
                out.append(x)
    return out
