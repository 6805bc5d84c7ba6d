"""The catalog's models and the models nodes hold, as the API lists them."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from psycopg.rows import class_row, scalar_row

from neuralgrid.db.queries.query import Query

__all__ = [
    "MODEL",
    "MODELS",
    "MODEL_KINDS",
    "MODEL_UNDER_VERIFICATION",
    "ModelInfo",
    "ModelKind",
    "ServedModel",
]


@dataclass(frozen=True)
class ModelKind:
    """A catalog model's kind (chat, completion, embedding…), context length in tokens and
    per-token prices (USD per million; None: unpriced)."""

    id: str
    kind: str
    context_length: int
    input_usd_per_mtok: Decimal | None = None
    output_usd_per_mtok: Decimal | None = None


MODEL_KINDS = Query(
    "model_kinds",
    "select id, kind, context_length, input_usd_per_mtok, output_usd_per_mtok from public.models",
    class_row(ModelKind),
)


@dataclass(frozen=True)
class ServedModel:
    id: str
    online_nodes: int
    in_catalog: bool
    created: int  # Unix time: the catalog's entry, else the first holder's registration


MODELS = Query(
    "models",
    """
select m.id, count(n.id) filter (where n.status in ('online', 'busy')) as online_nodes,
  bool_or(c.id is not null) as in_catalog,
  floor(extract(epoch from coalesce(min(c.created_at), min(n.created_at))))::int8 as created
from (select id from public.models union select model_id from public.node_models) m (id)
left join public.models c on c.id = m.id
left join public.node_models nm on nm.model_id = m.id
left join public.nodes n on n.id = nm.node_id
group by m.id order by m.id
""",
    class_row(ServedModel),
)


@dataclass(frozen=True)
class ModelInfo:
    """One model for GET /v1/models/{model}: its online nodes, its catalog kind (None when it is
    not in the catalog), and the routes its online nodes serve."""

    id: str
    online_nodes: int
    in_catalog: bool
    created: int  # as ServedModel's
    kind: str | None
    routes: list[str]


# No row: neither in the catalog nor held by any node.
MODEL = Query(
    "model",
    """
select %(model)s::text as id,
  count(distinct n.id) filter (where n.status in ('online', 'busy')) as online_nodes,
  c.id is not null as in_catalog, c.kind,
  floor(extract(epoch from coalesce(min(c.created_at), min(n.created_at))))::int8 as created,
  coalesce(array_agg(distinct r.route order by r.route)
           filter (where r.route is not null and n.status in ('online', 'busy')), '{}') as routes
from (select 1) one
left join public.models c on c.id = %(model)s
left join public.node_models nm on nm.model_id = %(model)s
left join public.nodes n on n.id = nm.node_id
left join lateral unnest(n.routes) as r (route) on true
group by c.id, c.kind
having c.id is not null or count(nm.node_id) > 0
""",
    class_row(ModelInfo),
)

# How many nodes have the model under verification (`neuralgrid models pin` says it once pinned).
MODEL_UNDER_VERIFICATION = Query(
    "model_under_verification",
    "select count(*) from public.model_checks where model_id = %s",
    scalar_row,
)
