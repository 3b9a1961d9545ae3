"""Events rate-limited and aggregated per job: a job stuck in one state posts one Event, not
one every few seconds.

The first Event of a (job, type, reason, message) goes out at once; repeats within
``interval_s`` are counted, not posted; the next one after the interval carries the count
("... (repeated 12 times in the last 60s)"). A different reason or message (a new repair, a
new plan) is a different stream. Pure: the caller passes the time.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 60.0


@dataclass(slots=True)
class _Stream:
    last_post: float
    suppressed: int = 0


class EventLimiter:
    """Decides which Events to post (see the module doc)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._streams: dict[tuple[Hashable, str, str, str], _Stream] = {}

    def admit(self, job: Hashable, type_: str, reason: str, message: str, now: float
              ) -> str | None:
        """The message to post now (with the repeat count when aggregated), or None to hold
        it back."""
        key = (job, type_, reason, message)
        stream = self._streams.get(key)
        if stream is None or now - stream.last_post >= self.interval_s:
            repeats = stream.suppressed if stream is not None else 0
            self._streams[key] = _Stream(last_post=now)
            if repeats:
                return f"{message} (repeated {repeats + 1} times in the last " \
                       f"{self.interval_s:.0f}s)"
            return message
        stream.suppressed += 1
        return None

    def forget(self, job: Hashable) -> None:
        """Drop a deleted job's streams."""
        for key in [k for k in self._streams if k[0] == job]:
            del self._streams[key]
