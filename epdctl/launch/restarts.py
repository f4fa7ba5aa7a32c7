"""The restart budget of one instance: restarts counted within a window, capped backoff (pure:
the supervisor passes the times in)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epdctl.launch.state import Settings

# 2**64 times any positive backoff is past every sane cap; a larger exponent (max_restarts is
# unbounded) would overflow the float.
_MAX_DOUBLINGS = 64


@dataclass(frozen=True)
class Budget:
    """At most `max_restarts` restarts within the last `window_s` seconds, each after a delay
    that doubles from `backoff_s` up to `max_backoff_s`."""

    max_restarts: int
    window_s: float
    backoff_s: float
    max_backoff_s: float

    @classmethod
    def of(cls, settings: Settings) -> Budget:
        return cls(settings.max_restarts, settings.restart_window_s, settings.backoff_s,
                   settings.max_backoff_s)

    def recent(self, times: Sequence[float], now: float) -> list[float]:
        """The restarts still counted at `now`: older ones are forgiven. A restart happens
        before the instance is ready again, so one ready for a whole window counts none."""
        return [t for t in times if now - t < self.window_s]

    def delay_s(self, recent: int) -> float:
        """The wait before the next restart of an instance restarted `recent` times within
        the window."""
        return min(self.backoff_s * 2.0 ** min(recent, _MAX_DOUBLINGS), self.max_backoff_s)

    def next_delay_s(self, times: Sequence[float], now: float) -> float | None:
        """The wait before restarting an instance that exited at `now`, having restarted at
        `times`; None when its budget for the window is spent."""
        recent = len(self.recent(times, now))
        return None if recent >= self.max_restarts else self.delay_s(recent)
