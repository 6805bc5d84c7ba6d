"""Private prompts: requests of different keys never share a node's prompt cache where its server can
keep them apart, and learn nothing of each other's where it cannot.

Every generation request goes to its node with a `cache_salt` of its key's (vLLM's and SGLang's
field: a prompt's cached blocks are found again only by a request with the same salt), in place of
any the client sent, so a client can name no other key's salt. The salt is an HMAC of the key's id
under a key only the gateways hold: every gateway sends the same salt for a key, so its requests
share their cache across gateways; a node learns that two requests came from one key (which their
shared cache would tell it anyway), never which key.

A server that cannot isolate (llama.cpp's, llama-cpp-python, Ollama, TGI) is the agent's to handle
(agent/servers: `ServerKind.cache_fields`): it drops the salt and strips the cache counts from the
answers (`cached_tokens`, llama.cpp's `timings`). What remains is the timing of a cached prompt,
unless the operator turns the shared cache off (NEURALGRID_SHARED_CACHE=off): then requests also say
`cache_prompt: false`, which llama-server honours per request, at the cost of reading every prompt
whole. docs/security.md says what each server keeps apart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any, Literal
from uuid import UUID

# What a gateway derives the salts from: settings.platform_key(SALTS).
SALTS = b"neuralgrid prompt cache salts v1"
# The requests a prompt cache serves (embeddings and audio keep nothing between requests).
CACHED_KINDS = frozenset({"chat", "completion", "responses"})

SharedCache = Literal["strip", "off"]
MAX_SALTS = 100_000  # keys' salts kept; past it, made again as their keys come


class PromptCaches:
    """Each key's salt, and what a request says of the cache, as the operator chose."""

    def __init__(self, platform_key: bytes, shared: SharedCache = "strip") -> None:
        self.platform_key = platform_key
        self.shared = shared
        self._salts: dict[UUID, str] = {}  # made once a key: an HMAC a request adds up

    def salt(self, key_id: UUID) -> str:
        """The key's salt: 22 URL-safe characters (128 bits), the same at every gateway."""
        salt = self._salts.get(key_id)
        if salt is None:
            if len(self._salts) >= MAX_SALTS:
                self._salts.clear()
            digest = hmac.new(self.platform_key, key_id.bytes, hashlib.sha256).digest()[:16]
            salt = self._salts[key_id] = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        return salt

    def apply(self, kind: str, body: dict[str, Any], key_id: UUID) -> int:
        """Sets the request's cache fields (in place): its key's salt, and with the shared cache off,
        `cache_prompt: false` for servers that cannot isolate but can skip their cache. Returns the
        bytes this adds to the body as json.dumps writes it: the platform's, not charged to the key's
        tokens per minute."""
        if kind not in CACHED_KINDS:
            return 0
        fields: dict[str, Any] = {"cache_salt": self.salt(key_id)}
        if self.shared == "off":  # a client may turn its own off, never the operator's choice on
            fields["cache_prompt"] = False
        added = 0
        for name, value in fields.items():
            before = len(json.dumps(body[name])) if name in body else -len(f', "{name}": ')
            added += len(json.dumps(value)) - before
            body[name] = value
        return added
