"""One prompt's measured result (:class:`Run`): what every runner returns and every statistic reads, kept
apart from both so that the analysis needs no model code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    accept_lengths: list[int]
    timers_ms: dict[str, float] = field(default_factory=dict)
    head_stats: dict[str, float] = field(default_factory=dict)
    prefill_s: float = 0.0
    trace: list[dict[str, float]] = field(default_factory=list)  # NanoSpec/hybrid, per round of the first turn
    turns: int = 1
    mode_rounds: dict[str, int] = field(default_factory=dict)  # target forwards per mode (the engine's guard)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    def __add__(self, other: Run) -> Run:
        """Two turns of one prompt: tokens, times and rounds add up; the head's stats are the last turn's, the
        trace the first turn's (the head starts afresh on every request, so traces do not concatenate)."""
        timers = dict(self.timers_ms)
        for k, v in other.timers_ms.items():
            timers[k] = timers.get(k, 0.0) + v
        return Run(
            self.tokens + other.tokens,
            self.wall_s + other.wall_s,
            self.accept_lengths + other.accept_lengths,
            timers,
            other.head_stats or self.head_stats,
            self.prefill_s + other.prefill_s,
            self.trace or other.trace,
            self.turns + other.turns,
            add_counts(self.mode_rounds, other.mode_rounds),
        )


def add_counts(*counts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out
