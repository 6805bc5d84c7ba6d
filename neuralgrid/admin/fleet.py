"""Load a fleet of nodes from JSON and list the nodes with their models and health."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from neuralgrid.db.errors import InvalidRequest, translate


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
    status: Literal["online", "busy", "offline", "draining"] = "online"
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
            raise InvalidRequest(f"{path}: node {i} ({where}): {first['msg']}") from err
    return specs


UPSERT_NODE = """
insert into public.nodes as n (name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate, region,
  latitude, longitude, endpoint_url, status, max_concurrency, last_heartbeat_at, backend)
values (%(name)s, %(gpu_model)s, %(gpu_count)s, %(vram_gb)s, %(tflops)s, %(hourly_rate)s, %(region)s,
  %(latitude)s, %(longitude)s, %(endpoint_url)s, %(status)s, %(max_concurrency)s,
  case when %(status)s = 'offline' then null else now() end, %(backend)s)
on conflict (owner_id, name) do update set
  gpu_model = excluded.gpu_model, gpu_count = excluded.gpu_count, vram_gb = excluded.vram_gb,
  tflops = excluded.tflops, hourly_rate = excluded.hourly_rate, region = excluded.region,
  latitude = excluded.latitude, longitude = excluded.longitude, endpoint_url = excluded.endpoint_url,
  status = excluded.status, max_concurrency = excluded.max_concurrency,
  last_heartbeat_at = excluded.last_heartbeat_at, backend = excluded.backend
returning n.id
"""

REPLACE_MODELS = """
with wanted as (
  select m, 'loaded' as state from unnest(%(loaded)s::text[]) m
  union all
  select m, 'available' from unnest(%(available)s::text[]) m where m <> all (%(loaded)s::text[])
), gone as (
  delete from public.node_models nm
  where nm.node_id = %(id)s and nm.model_id not in (select m from wanted)
)
insert into public.node_models (node_id, model_id, state)
select %(id)s, m, state from wanted
on conflict (node_id, model_id) do update set state = excluded.state
"""


def import_fleet(conn: psycopg.Connection, specs: list[NodeSpec]) -> list[UUID]:
    """Insert or update (by name) every node and its models, all or nothing."""
    ids: list[UUID] = []
    current = ""
    try:
        with conn.transaction():
            for spec in specs:
                current = spec.name
                row = conn.execute(
                    UPSERT_NODE, {**spec.model_dump(), "backend": Jsonb(spec.backend)}
                ).fetchone()
                assert row is not None
                ids.append(row[0])
                conn.execute(
                    REPLACE_MODELS,
                    {"id": row[0], "loaded": spec.models, "available": spec.available_models},
                )
    except psycopg.Error as err:
        domain = translate(err)
        raise type(domain)(f"node {current!r}: {domain}") from err
    return ids


LIST_NODES = """
select m.id, m.name, m.gpu_model, m.gpu_count, m.vram_gb, m.tflops, m.hourly_rate::float8 as hourly_rate,
  m.region, m.latitude, m.longitude, m.status, m.inflight, m.max_concurrency, m.last_heartbeat_at,
  m.successes, m.failures, m.ewma_latency_ms, m.ewma_tokens_per_s, m.cooldown_until,
  m.warm_models, m.available_models
from public.node_map m
order by m.region, m.name
"""


def list_nodes(conn: psycopg.Connection) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(LIST_NODES).fetchall()


def to_json(rows: list[dict[str, Any]]) -> str:
    def default(value: object) -> str:
        if isinstance(value, datetime | UUID):
            return str(value)
        raise TypeError(type(value).__name__)

    return json.dumps(rows, default=default, indent=2)
