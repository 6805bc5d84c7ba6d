"""Signed gateway-to-agent requests: forged, altered, stale or replayed ones are refused."""

from __future__ import annotations

import time

import pytest

from neuralgrid.protocol import signing

KEY = signing.node_key("the node's secret")
BODY = b'{"model": "m"}'


def test_a_signed_request_is_accepted_once() -> None:
    verifier = signing.Verifier()
    header = signing.sign(KEY, "/v1/chat/completions", BODY)
    assert verifier.verify(KEY, header, "/v1/chat/completions", BODY)
    assert not verifier.verify(KEY, header, "/v1/chat/completions", BODY)  # the replay
    assert verifier.verify(KEY, signing.sign(KEY, "/v1/chat/completions", BODY), "/v1/chat/completions", BODY)


@pytest.mark.parametrize(
    ("key", "path", "body", "age_s"),
    [
        (signing.node_key("another secret"), "/v1/chat/completions", BODY, 0),
        (KEY, "/v1/embeddings", BODY, 0),
        (KEY, "/v1/chat/completions", b'{"model": "n"}', 0),
        (KEY, "/v1/chat/completions", BODY, 61),
    ],
)
def test_forged_altered_or_stale_signatures_are_refused(
    key: bytes, path: str, body: bytes, age_s: float
) -> None:
    header = signing.sign(key, "/v1/chat/completions", BODY, now=time.time() - age_s)
    assert not signing.Verifier().verify(KEY, header, path, body)


def test_a_signature_without_a_nonce_is_refused() -> None:
    timestamp = int(time.time())
    full = signing.sign(KEY, "/p", BODY, now=timestamp)
    without = ",".join(part for part in full.split(",") if not part.startswith("n="))
    for header in (without, "", "t=1", "garbage", f"t={timestamp},n=short,v1=00"):
        assert not signing.Verifier().verify(KEY, header, "/p", BODY), header


def test_nonces_are_forgotten_once_their_signatures_would_be_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    verifier = signing.Verifier(max_age_s=60)
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    for _ in range(100):
        assert verifier.verify(KEY, signing.sign(KEY, "/p", BODY), "/p", BODY)
    assert len(verifier._seen) == 100
    clock[0] += 121
    assert verifier.verify(KEY, signing.sign(KEY, "/p", BODY), "/p", BODY)
    assert len(verifier._seen) == 1  # memory bounded by the rate, not the uptime
