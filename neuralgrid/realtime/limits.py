"""What one client socket may ask of the Realtime server: how big, how often, how many, and where.

Supabase Realtime limits a project (messages and bytes per second, channels per connection, payload
size); the embedded server holds the same limits per socket, so one anonymous socket cannot flood
the feed, the overflow table or every gateway's presence memory. Every check is O(1) per event.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neuralgrid.server.settings import Settings

# Topic and presence-key names travel in every feed notification about them; keep them far below
# NOTIFY's 8000 bytes, so room announcements never spill into realtime.feed_overflow.
MAX_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = 65_536  # any client message, as sent on the socket
    max_presence_bytes: int = 8_192  # a presence meta: kept in memory while tracked
    events_per_s: float = 100.0  # per socket; the bucket holds two seconds' worth
    bytes_per_s: float = 262_144.0  # per socket; the bucket holds four seconds' worth
    max_channels: int = 100  # joined channels per socket, as on Supabase
    max_presences: int = 10  # channels of one socket that track presence at once
    # Public topics the platform itself publishes on: clients read them, only service_role writes.
    read_only_topics: frozenset[str] = frozenset({"node-map", "map:summary"})

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            max_message_bytes=settings.realtime_max_message_bytes,
            max_presence_bytes=settings.realtime_max_presence_bytes,
            events_per_s=settings.realtime_events_per_s,
            bytes_per_s=settings.realtime_bytes_per_s,
            max_channels=settings.realtime_max_channels,
            max_presences=settings.realtime_max_presences,
            read_only_topics=frozenset(settings.realtime_read_only_topics),
        )


class TokenBucket:
    """`rate` tokens a second, up to `capacity`. Refused takes are charged too, down to -capacity:
    a client that keeps sending past its limit runs into debt instead of getting a fresh bucket
    every second, and one that backs off recovers."""

    __slots__ = ("capacity", "rate", "stamp", "tokens")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.stamp = now

    def take(self, cost: float, now: float) -> float:
        """Charges `cost` and returns what is left: negative means over the limit."""
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate) - cost
        self.stamp = now
        return self.tokens

    @property
    def exhausted(self) -> bool:
        """In debt by a whole bucket: sustained abuse, not a burst."""
        return self.tokens <= -self.capacity


class Verdict(Enum):
    ALLOW = "allow"
    REFUSE = "refuse"
    CLOSE = "close"


class Throttle:
    """A socket's message and byte budgets."""

    __slots__ = ("bytes", "events")

    def __init__(self, limits: Limits, now: float) -> None:
        self.events = TokenBucket(limits.events_per_s, 2 * limits.events_per_s, now)
        self.bytes = TokenBucket(limits.bytes_per_s, 4 * limits.bytes_per_s, now)

    def admit(self, size: int, now: float) -> Verdict:
        events_left = self.events.take(1, now)
        bytes_left = self.bytes.take(size, now)
        if events_left >= 0 and bytes_left >= 0:
            return Verdict.ALLOW
        if self.events.exhausted or self.bytes.exhausted:
            return Verdict.CLOSE
        return Verdict.REFUSE


# Refusals, worded as Supabase Realtime words its own ("<Code>: <message>").
RATE_LIMITED = "ClientRateLimitReached: Too many messages per second"
TOO_MANY_CHANNELS = "ChannelRateLimitReached: Too many channels"
NAME_TOO_LONG = f"TopicNameTooLong: topics and presence keys are at most {MAX_NAME_CHARS} characters"


def too_large(size: int, limit: int) -> str:
    return f"PayloadSizeExceeded: the message is {size} bytes; the limit is {limit}"


def too_many_presences(limit: int) -> str:
    return f"PresenceRateLimitReached: a socket tracks presence on at most {limit} channels"
