"""The kinds of request the gateway passes to nodes: the route each takes (and so the nodes that may
serve it), the catalog models that serve it, whether it streams, and which field bounds its answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuralgrid.protocol.routes import ECHO, Route, path

ROUTES: dict[str, Route] = {
    "chat": "chat/completions",
    "completion": "completions",
    "embedding": "embeddings",
    "responses": "responses",
    "rerank": "rerank",
    "score": "score",
    "transcription": "audio/transcriptions",
    "translation": "audio/translations",
    "speech": "audio/speech",
}
PATHS = {kind: path(route) for kind, route in ROUTES.items()}


def matched_route(kind: str, body: Mapping[str, Any]) -> str:
    """The route the matcher looks for nodes serving: the kind's, or for a completion that asks to
    echo its prompt, the echo route (only nodes whose server echoes serve it)."""
    return ECHO if kind == "completion" and body.get("echo") is True else ROUTES[kind]


# The kinds whose answer a client may have streamed (chat and completions in OpenAI's chunks, the
# Responses API in its response.* events).
STREAMING = frozenset({"chat", "completion", "responses"})
# The kinds that generate text, by the field that bounds the answer (what budgets cap and hold).
ANSWER_LIMIT = {"chat": "max_tokens", "completion": "max_tokens", "responses": "max_output_tokens"}
# Uploads: multipart/form-data, passed to the node as they came.
FORMS = frozenset({"transcription", "translation"})
# What a catalog model of each kind serves (models.kind; an uncatalogued model: whatever its nodes do).
SERVED_BY: dict[str, frozenset[str]] = {
    "chat": frozenset({"chat", "completion", "responses"}),
    "completion": frozenset({"chat", "completion", "responses"}),
    "embedding": frozenset({"embedding", "rerank", "score"}),
    "rerank": frozenset({"rerank", "score"}),
    "transcription": frozenset({"transcription", "translation"}),
    "speech": frozenset({"speech"}),
}
