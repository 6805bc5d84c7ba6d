"""Load a fleet of nodes from JSON and list the nodes with their models and health."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from neuralgrid import validation
from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError, InvalidRequest
from neuralgrid.db.queries import NodeStatus
from neuralgrid.db.store import SyncStore


class NodeSpec(BaseModel):
    """A node as a fleet file describes it: the nodes table's fields plus its model ids."""

    model_config = ConfigDict(extra="forbid")

    name: str
    gpu_model: str
    gpu_count: int = 1
    vram_gb: float
    tflops: float
    hourly_rate: float
    region: str
    latitude: float | None = None
    longitude: float | None = None
    endpoint_url: str | None = None
    status: NodeStatus = "online"
    max_concurrency: int = 4
    models: list[str] = Field(default_factory=list)
    available_models: list[str] = Field(default_factory=list)
    # What an agent would have found of the server (see docs/backends.md); {} for unknown.
    backend: dict[str, Any] = Field(default_factory=dict)


def read_fleet(path: Path) -> list[NodeSpec]:
    """Parse and validate a fleet file (a JSON list of nodes); errors name the node and field."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise InvalidRequest(f"{path}: {err}") from err
    if not isinstance(raw, list):
        raise InvalidRequest(f"{path}: expected a JSON list of nodes")
    specs: list[NodeSpec] = []
    for i, item in enumerate(raw):
        try:
            specs.append(NodeSpec.model_validate(item))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequest(f"{path}: node {i} ({where}): {validation.message(first)}") from err
    return specs


def import_fleet(conn: psycopg.Connection, specs: list[NodeSpec]) -> list[UUID]:
    """Insert or update (by name) every node and its models, all or nothing."""
    ids: list[UUID] = []
    current = ""
    store = SyncStore(conn)
    try:
        with store.transaction():
            for spec in specs:
                current = spec.name
                node_id = store.get(q.UPSERT_NODE, {**spec.model_dump(), "backend": Jsonb(spec.backend)})
                ids.append(node_id)
                models = {"id": node_id, "loaded": spec.models, "available": spec.available_models}
                store.all(q.REPLACE_NODE_MODELS, models)
    except DatabaseError as err:
        raise type(err)(f"node {current!r}: {err}") from err
    return ids


def list_nodes(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    return SyncStore(conn).all(q.FLEET)
