"""Stage 1, admit: what the client asked, checked against the catalog and the key's limits, and
the body the nodes will be sent (usage asked for on streams; the answer bounded by the hold)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway import errors
from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.pipeline.kinds import ANSWER_LIMIT, PATHS, SERVED_BY, STREAMING
from neuralgrid.gateway.prompt_cache import PromptCaches
from neuralgrid.gateway.ratelimit import RateLimiter, TokenHold, estimate_tokens

log = logging.getLogger(__name__)

CATALOG_TTL_S = 60.0
# The longest answer asked of a model the catalog does not know (its context length is unknown; the
# catalog's longest is 131,072 tokens).
UNCATALOGUED_MAX_TOKENS = 131_072


JSON = "application/json"
# Content parts that name media the server fetches itself (OpenAI's image_url, vLLM's video_url and
# audio_url, the Responses API's input_image and input_file): a few bytes of the request, and any
# number of the prompt's tokens.
MEDIA_KEYS = ("image_url", "video_url", "audio_url", "file_url")


@dataclass(frozen=True)
class Call:
    """A client's request as the gateway received it."""

    kind: str  # chat, completion, embedding, responses, rerank, score, transcription, translation, speech
    body: dict[str, Any]  # the JSON body; for an upload, its text fields
    key: ApiKey
    region: str | None = None
    max_hourly_rate: float | None = None
    policy: str = "balanced"
    received: float = field(default_factory=time.perf_counter)
    upload: bytes | None = None  # a multipart body, passed to the node unchanged
    content_type: str = JSON  # the upload's (its boundary with it)
    # Returns when the client hangs up; watched while the request waits in line for a slot.
    gone: Callable[[], Awaitable[object]] | None = None

    @property
    def model(self) -> str:
        return str(self.body["model"])


@dataclass(frozen=True)
class Admitted:
    """A call let in: what the nodes are sent, and the longest answer it may get (match_job() prices
    the budget hold from the payload's size and that)."""

    call: Call
    body: dict[str, Any]  # as the nodes get it
    payload: bytes
    stream: bool
    max_output_tokens: int  # over all choices (n)
    tpm_hold: TokenHold | None = None  # the estimate held on the key's tpm limit, settled at the end
    limit_headers: Mapping[str, str] = field(default_factory=dict)  # x-ratelimit-*, for the answer
    content_type: str = JSON  # the payload's
    # The most prompt tokens a node may report: None for a token a byte of the payload (meter.py);
    # the model's context for a prompt of media by reference.
    prompt_limit: int | None = None

    def capped(self, max_output_tokens: int) -> Admitted:
        """The same call told to answer in fewer tokens (what its key's budget pays for)."""
        limit = ANSWER_LIMIT.get(self.call.kind)
        if max_output_tokens >= self.max_output_tokens or limit is None:
            return self
        choices = answers(self.body)
        body = {**self.body, limit: max(1, max_output_tokens // choices)}
        payload = json.dumps(body).encode()
        return replace(self, body=body, payload=payload, max_output_tokens=max_output_tokens)


def media_by_reference(payload: bytes, body: dict[str, Any]) -> bool:
    """Whether the prompt names media by URL (a data: URL is inline: bytes of the payload)."""
    if not any(key.encode() in payload for key in MEDIA_KEYS):  # most requests: one scan of bytes
        return False
    return _names_media(body.get("messages")) or _names_media(body.get("input"))


def _names_media(value: Any) -> bool:
    if isinstance(value, list):
        return any(_names_media(item) for item in value)
    if not isinstance(value, dict):
        return False
    for key in MEDIA_KEYS:
        ref = value.get(key)
        url = ref.get("url") if isinstance(ref, dict) else ref
        if isinstance(url, str) and not url.startswith("data:"):
            return True
    return any(_names_media(v) for v in value.values() if isinstance(v, list | dict))


def _a(word: str) -> str:
    """The word with its article: an embedding model, a chat model."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def answers(body: dict[str, Any]) -> int:
    """How many answers a request asks for: n for each prompt, and a completion takes several
    prompts at once (a list of strings, or of token lists; a list of numbers is one prompt)."""
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return max(1, int(body.get("n") or 1)) * prompts


class Catalog:
    """The catalog's model kinds and prices, reloaded every minute: in the background once loaded,
    so that no request waits on Postgres for it after the first."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.models: dict[str, q.ModelKind] = {}
        self.loaded_at = float("-inf")
        self._reloading: asyncio.Task[None] | None = None

    async def get(self, model: str) -> q.ModelKind | None:
        if self.loaded_at == float("-inf"):
            await self._load()
        elif time.monotonic() - self.loaded_at > CATALOG_TTL_S and self._reloading is None:
            self._reloading = asyncio.get_running_loop().create_task(self._reload())
        return self.models.get(model)

    async def _load(self) -> None:
        self.models = {row.id: row for row in await self.store.all(q.MODEL_KINDS)}
        self.loaded_at = time.monotonic()

    async def _reload(self) -> None:
        try:
            await self._load()
        except Exception:  # the last catalog serves on; the next request tries again
            log.warning("could not reload the catalog", exc_info=True)
        finally:
            self._reloading = None


class Admission:
    def __init__(
        self, catalog: Catalog, limiter: RateLimiter, default_max_tokens: int, caches: PromptCaches
    ) -> None:
        self.catalog = catalog
        self.limiter = limiter
        self.default_max_tokens = default_max_tokens
        self.caches = caches

    async def admit(self, call: Call) -> Admitted:
        entry = await self.catalog.get(call.model)
        if entry is not None and call.kind not in SERVED_BY.get(entry.kind, {call.kind}):
            # A server would fail it (HTTP 500 or 501), which is no node's fault.
            raise errors.BadRequest(
                f"{call.model} is {_a(entry.kind)} model: it does not serve {PATHS[call.kind]}", param="model"
            )
        stream = bool(call.body.get("stream")) and call.kind in STREAMING
        body = dict(call.body)
        if stream and call.kind != "responses":  # ask for usage to meter; stripped if the client did not
            body["stream_options"] = {**(call.body.get("stream_options") or {}), "include_usage": True}
        added = self.caches.apply(call.kind, body, call.key.id)
        max_out = 0
        if call.kind in ANSWER_LIMIT:
            max_out = self._max_tokens(call, body, entry)
            max_out *= answers(call.body)
        payload = call.upload if call.upload is not None else json.dumps(body).encode()
        prompt_limit = None
        if media_by_reference(payload, body):
            prompt_limit = entry.context_length if entry else UNCATALOGUED_MAX_TOKENS
        # Limited last, once the request is known to be valid: its tpm charge is this estimate.
        allowed = await self.limiter.admit(call.key, estimate_tokens(len(payload) - added, max_out))
        hold, headers = allowed.hold, allowed.headers
        return Admitted(
            call, body, payload, stream, max_out, hold, headers, call.content_type, prompt_limit=prompt_limit
        )

    def _max_tokens(self, call: Call, body: dict[str, Any], entry: q.ModelKind | None) -> int:
        """The answer's length per choice, at most the model's context. A key with a budget always
        tells the node (its hold assumes that length, so the charge can never exceed it); a key
        without one leaves the server's default when the client gave none."""
        field_name = ANSWER_LIMIT[call.kind]  # max_tokens; the Responses API's max_output_tokens
        asked = body.pop(field_name, None) or body.pop("max_completion_tokens", None)
        body.pop("max_completion_tokens", None)  # one field for every server; null never reaches one
        limit = entry.context_length if entry else UNCATALOGUED_MAX_TOKENS
        if asked is not None and asked > limit:
            raise errors.BadRequest(
                f"{field_name} is too large: {asked}. {call.model} supports at most {limit} tokens",
                param=field_name,
            )
        if asked is None and call.key.budget_usd is None:
            return limit
        max_tokens = int(asked or min(self.default_max_tokens, limit))
        body[field_name] = max_tokens
        return max_tokens
