"""The OpenAPI document as the gateway behaves: request bodies for the routes that validate their own
JSON (chat, completions, embeddings, node registration and heartbeats), and OpenAI's error shape on
400 where FastAPI would declare its 422 (which this gateway never answers). Fuzzers and client
generators read it (tests/gateway/test_fuzz.py runs schemathesis against it)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from neuralgrid.gateway.schema import SCHEMAS
from neuralgrid.protocol.nodes import Heartbeat, NodeRegistration

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": SCHEMAS["chat"],
    "/v1/completions": SCHEMAS["completion"],
    "/v1/embeddings": SCHEMAS["embedding"],
    "/v1/nodes": NodeRegistration,
    "/v1/nodes/{node_id}/heartbeat": Heartbeat,
}

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def document(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
        components["Error"] = ERROR
        error = {
            "description": "The request is invalid (OpenAI's error shape)",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for operations in schema["paths"].values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if operation.get("parameters") or operation.get("requestBody"):
                    responses["400"] = error
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
