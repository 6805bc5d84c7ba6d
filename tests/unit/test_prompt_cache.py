"""Each key's prompt-cache salt, as the gateway puts it in a request (gateway/prompt_cache.py)."""

from __future__ import annotations

import json
import uuid

from neuralgrid.gateway.prompt_cache import PromptCaches

KEY_A, KEY_B = uuid.uuid4(), uuid.uuid4()


def test_a_keys_salt_is_the_same_at_every_gateway_and_no_other_keys() -> None:
    one, other = PromptCaches(b"platform key"), PromptCaches(b"platform key")
    assert one.salt(KEY_A) == other.salt(KEY_A)  # its requests share their cache across gateways
    assert one.salt(KEY_A) != one.salt(KEY_B)
    assert PromptCaches(b"another platform").salt(KEY_A) != one.salt(KEY_A)  # not from the key id alone
    assert len(one.salt(KEY_A)) == 22 and str(KEY_A) not in one.salt(KEY_A)


def test_a_request_carries_its_keys_salt_whatever_the_client_sent() -> None:
    caches = PromptCaches(b"platform key")
    body = {"messages": [], "cache_salt": caches.salt(KEY_B), "cache_prompt": False}
    caches.apply("chat", body, KEY_A)
    assert body == {"messages": [], "cache_salt": caches.salt(KEY_A), "cache_prompt": False}
    embedding: dict[str, object] = {"input": "x"}
    caches.apply("embedding", embedding, KEY_A)  # no cache between requests to keep apart
    assert embedding == {"input": "x"}


def test_with_the_shared_cache_off_every_request_skips_it() -> None:
    caches = PromptCaches(b"platform key", shared="off")
    for kind in ("chat", "completion", "responses"):
        body = {"cache_prompt": True}
        caches.apply(kind, body, KEY_A)
        assert body == {"cache_prompt": False, "cache_salt": caches.salt(KEY_A)}


def test_what_the_fields_add_to_a_body_is_told_as_json_writes_it() -> None:
    """The platform's bytes, not the client's: the key's tokens-per-minute estimate leaves them out."""
    for shared in ("strip", "off"):
        caches = PromptCaches(b"platform key", shared=shared)
        for sent in (
            {"model": "m"},
            {"model": "m", "cache_salt": "a much longer salt than ours", "cache_prompt": 1},
        ):
            body = dict(sent)
            added = caches.apply("chat", body, KEY_A)
            assert len(json.dumps(body)) - len(json.dumps(sent)) == added
