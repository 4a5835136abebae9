"""The never-slower-than-AR guard: chooses per round whether to draft, never what is committed."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardConfig:
    """Never slower than AR: once the speculative rate over the last ``window`` rounds (tokens committed per
    second of backbone + draft + verify + observe) is below ``margin`` times the AR step rate, decode ``ar_steps``
    tokens autoregressively, then probe speculation again.

    - Each probe that fails doubles the AR stretch, up to ``max_ar_steps``; a probe that beats AR resets it. The
      stretch is kept across requests (a request after one that speculation lost as a whole starts with it, and
      a stretch left unfinished carries on), so a drafter that never pays costs one probe per stretch, not a
      window per request, and a probe comes at least every ``max_ar_steps`` AR steps whatever the requests'
      lengths.
    - In a probe, two rounds already decide when speculation runs under ``Guard.PROBE_EARLY`` of the AR rate;
      otherwise a full window decides, so that a few unlucky rounds of a good drafter do not.
    - ``lean``: before AR, a lean rung (where the decoder's tree is larger than one draft token plus its lookup
      branch): where few drafts are accepted the cheapest draft wins, so a losing tree first hands over to one
      draft token a round (one head call); the lean rung falls to AR when it loses too, and probes after an AR
      stretch draft lean. After ``lean_rounds`` winning lean rounds the tree is probed again for a window and
      kept if it beats the lean rung's last window (else the next lean stretch doubles, up to
      ``max_ar_steps``)."""

    enabled: bool = True
    window: int = 8
    ar_steps: int = 8
    max_ar_steps: int = 128
    margin: float = 1.0
    lean: bool = True
    lean_rounds: int = 16

    def __post_init__(self) -> None:
        def whole(name: str, low: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"GuardConfig.{name} must be an integer >= {low}, got {v!r}")

        for flag in ("enabled", "lean"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"GuardConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        whole("window", 1)
        whole("lean_rounds", 1)
        whole("ar_steps", 1)
        whole("max_ar_steps", self.ar_steps)
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, int | float) or not (0 < m < math.inf):
            raise ValueError(f"GuardConfig.margin must be a finite number > 0, got {m!r}")


class Guard:
    """GuardConfig's state machine. The AR step estimate (median of recent AR step times, seeded by a
    measured ``ar_step_s`` when one is given) lives as long as the decoder; the rest is per request."""

    SAMPLES = 32  # AR step times the median is taken over
    PROBE_EARLY = 0.75  # in a probe, two rounds under this fraction of the AR rate send it back to AR

    def __init__(
        self,
        cfg: GuardConfig,
        ar_step_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        has_lean: bool = False,
    ) -> None:
        """``has_lean``: the decoder has a lean tree smaller than its own (the rung is used if ``cfg.lean``)."""
        self.check_ar_step_s(ar_step_s)
        self.cfg, self.clock = cfg, clock
        self.has_lean = has_lean and cfg.lean and cfg.enabled
        self.ar_times: deque[float] = deque([] if ar_step_s is None else [float(ar_step_s)], maxlen=self.SAMPLES)
        self.stretch = cfg.ar_steps  # the next stretch, should speculation lose (kept across requests)
        self.spent = (0, 0.0)  # the last request's counted speculative rounds: (tokens, seconds)
        self.lost = False  # whether speculation lost over the last request that had any
        self.begin()

    @staticmethod
    def check_ar_step_s(ar_step_s: float | None) -> None:
        """A measured AR step time: None, or a finite number of seconds > 0."""
        if ar_step_s is not None and not (0 < ar_step_s < math.inf):
            raise ValueError(f"ar_step_s must be a finite number of seconds > 0, got {ar_step_s!r}")

    @property
    def ar_step_s(self) -> float | None:
        return statistics.median(self.ar_times) if self.ar_times else None

    def _slower(self, tokens: int, seconds: float, factor: float = 1.0) -> bool:
        ar_s = self.ar_step_s
        return ar_s is not None and seconds > 0 and tokens * ar_s < factor * self.cfg.margin * seconds

    def begin(self) -> None:
        """A new request: speculate first, unless speculation lost over the whole last request (a drafter that
        never pays then costs one probe per stretch, not a window per request)."""
        speculated = self.spent[1] > 0
        if speculated:  # (a request decoded all in AR leaves the verdict as it was)
            self.lost = self._slower(*self.spent)
        lost = self.cfg.enabled and self.lost
        if not lost:
            self.ar_left = 0
        elif speculated and not self.ar_left:  # lost while speculating: a stretch first
            self.ar_left = self.stretch
        # else the AR steps still owed before the next probe (none: the probe is due now)
        self.rounds: deque[tuple[int, float]] = deque(maxlen=self.cfg.window)  # (tokens, seconds)
        self.warm = False  # the first round after prefill or an AR stretch (its long catch-up) is not counted
        self.probing = lost  # rounds right after an AR stretch
        self.lean_stretch = self.cfg.lean_rounds
        self.lean = lost and self.has_lean  # drafting with the lean tree (a probe after AR steps is lean)
        self.lean_left = self.lean_stretch  # lean rounds before the tree is probed again
        self.lean_rate = 0.0  # tokens / s over the lean rung's last full window
        self.tree_probe = False  # a window of the tree after a lean stretch
        self.spent = (0, 0.0)
        self.counts = {"speculative": 0, "ar": 0, "lean": 0}

    @property
    def ar(self) -> bool:
        """Whether the next step is an AR step."""
        return self.ar_left > 0

    def record(self, tokens: int, seconds: float) -> None:
        """One step done: an AR step if ``ar`` was true, else a speculative round that committed ``tokens``."""
        if self.ar_left:
            self.counts["ar"] += 1
            self.ar_times.append(seconds)
            self.ar_left -= 1
            return
        self.counts["speculative"] += 1
        if self.lean:
            self.counts["lean"] += 1
            self.lean_left -= 1
        if not self.cfg.enabled or not self.warm:
            self.warm = True
            return
        self.rounds.append((tokens, seconds))
        self.spent = (self.spent[0] + tokens, self.spent[1] + seconds)
        toks, secs = sum(t for t, _ in self.rounds), sum(s for _, s in self.rounds)
        # a full window decides; in a probe after an AR stretch two rounds already do when speculation runs
        # well under the AR rate (probing a drafter that never hits for a whole window cost more than the
        # guard saved; at the start of a request, two unlucky rounds of a good drafter must not decide)
        early = self.probing and len(self.rounds) >= 2 and self._slower(toks, secs, self.PROBE_EARLY)
        if len(self.rounds) < self.cfg.window and not early:
            return
        if self.ar_step_s is None:  # nothing to compare with yet: an AR stretch measures it (its tokens are real)
            self._to_ar(self.cfg.ar_steps)
        elif self.tree_probe and toks < self.lean_rate * secs:  # the tree lost to the lean rung again
            self._to_lean(min(2 * self.lean_stretch, self.cfg.max_ar_steps))
        elif self._slower(toks, secs):
            if self.has_lean and not self.lean:  # the lean rung first
                self._to_lean(self.lean_stretch)
            else:
                self._to_ar(self.stretch)
                self.stretch = min(2 * self.stretch, self.cfg.max_ar_steps)
        else:
            self.stretch, self.probing = self.cfg.ar_steps, False
            if self.lean:
                self.lean_rate = toks / secs
                if self.lean_left <= 0:  # probe the tree again
                    self.lean, self.tree_probe = False, True
                    self.rounds.clear()
            elif self.tree_probe:  # the tree beat the lean rung: back to it
                self.tree_probe, self.lean_stretch = False, self.cfg.lean_rounds

    def _to_lean(self, rounds: int) -> None:
        self.lean, self.lean_left, self.lean_stretch, self.tree_probe = True, rounds, rounds, False
        self.rounds.clear()

    def _to_ar(self, steps: int) -> None:
        self.ar_left, self.warm, self.probing = steps, False, True
        self.lean, self.lean_left, self.tree_probe = self.has_lean, self.lean_stretch, False  # the probe: lean
        self.rounds.clear()
