"""Requests from the gateway to a node agent carry an HMAC signature the agent checks.

The key is the SHA-256 of the node's secret: the agent derives it from the secret it holds, the
gateway reads it from the database (which stores only that hash). A signature covers a timestamp,
the path and the body, and is refused after `max_age_s`, so a captured request cannot be replayed
later or against another path.
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "x-neuralgrid-signature"


def node_key(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def sign(key: bytes, path: str, body: bytes, now: float | None = None) -> str:
    timestamp = int(now if now is not None else time.time())
    mac = hmac.new(key, f"{timestamp}.{path}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(key: bytes, header: str | None, path: str, body: bytes, max_age_s: float = 60) -> bool:
    if not header:
        return False
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
        given = fields["v1"]
    except (KeyError, ValueError):
        return False
    if abs(time.time() - timestamp) > max_age_s:
        return False
    expected = hmac.new(key, f"{timestamp}.{path}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, given)
