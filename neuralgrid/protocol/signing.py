"""Requests from the gateway to a node agent carry an HMAC signature the agent checks.

The key is the node's request key: an HMAC of the SHA-256 of its secret (what the database stores,
to check its heartbeats) under a key only the gateways hold (NEURALGRID_INTERNAL_SECRET's). A gateway
derives it for each request; the agent is given it at registration. So a read of the database, or a
leak of its `secret_hash` column, signs nothing (a security review leaked that column through
Realtime and had a node serve requests it signed). A signature covers a timestamp, a random nonce,
the path and the body. The agent refuses one older than `max_age_s`, and one whose nonce it has
already seen in that window: a captured request cannot be replayed, later or at once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

HEADER = "x-neuralgrid-signature"


# What a gateway derives nodes' request keys from: settings.platform_key(REQUEST_KEYS).
REQUEST_KEYS = b"neuralgrid node request keys v1"


def node_key(secret: str) -> bytes:
    """The SHA-256 of a node's secret: what the database keeps of it (nodes.secret_hash)."""
    return hashlib.sha256(secret.encode()).digest()


def request_key(platform_key: bytes, secret_hash: bytes) -> bytes:
    """The key a node's requests are signed with, from its secret's hash and the gateways' key."""
    return hmac.new(platform_key, secret_hash, hashlib.sha256).digest()


def _mac(key: bytes, timestamp: int, nonce: str, path: str, body: bytes) -> str:
    return hmac.new(key, f"{timestamp}.{nonce}.{path}.".encode() + body, hashlib.sha256).hexdigest()


def sign(key: bytes, path: str, body: bytes, now: float | None = None, nonce: str | None = None) -> str:
    timestamp = int(now if now is not None else time.time())
    nonce = nonce or secrets.token_hex(12)
    return f"t={timestamp},n={nonce},v1={_mac(key, timestamp, nonce, path, body)}"


class Verifier:
    """Checks signatures and remembers the nonces of the last `max_age_s` (twice over, for clocks
    that disagree by up to max_age_s either way): memory is bounded by the node's request rate."""

    def __init__(self, max_age_s: float = 60) -> None:
        self.max_age_s = max_age_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten

    def verify(self, key: bytes, header: str | None, path: str, body: bytes) -> bool:
        if not header:
            return False
        try:
            fields = dict(part.split("=", 1) for part in header.split(","))
            timestamp, nonce, given = int(fields["t"]), fields["n"], fields["v1"]
        except (KeyError, ValueError):
            return False
        now = time.time()
        if abs(now - timestamp) > self.max_age_s or not 16 <= len(nonce) <= 64:
            return False
        if not hmac.compare_digest(_mac(key, timestamp, nonce, path, body), given):
            return False
        self._forget_before(now)
        if nonce in self._seen:
            return False  # a replay
        self._seen[nonce] = now + 2 * self.max_age_s
        return True

    def _forget_before(self, now: float) -> None:
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until > now:
                return
            del self._seen[nonce]
