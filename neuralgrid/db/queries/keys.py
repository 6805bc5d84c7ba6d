"""API keys: authentication's read, their lifecycle from the API and the CLI, and what a key used."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from uuid import UUID

from psycopg.rows import class_row, dict_row, scalar_row

from neuralgrid.db.queries.query import Query

__all__ = [
    "ACTIVE_KEYS_MATCHING",
    "ACT_AS_USER",
    "CREATE_KEY",
    "KEY_BY_HASH",
    "KEY_USAGE",
    "LISTEN_KEY_CHANGES",
    "LIST_KEYS",
    "REVOKE_KEY",
    "USER_BY_ID_OR_EMAIL",
    "ActiveKey",
    "CreatedKey",
    "KeyRecord",
    "KeyUsage",
]


@dataclass(frozen=True)
class KeyRecord:
    """An API key as authentication reads it (never the key itself: its SHA-256)."""

    id: UUID
    owner_id: UUID | None
    name: str
    key_hash: bytes
    rpm_limit: int | None
    tpm_limit: int | None
    budget_usd: Decimal | None
    revoked: bool


@dataclass(frozen=True)
class CreatedKey:
    id: UUID
    api_key: str
    prefix: str


@dataclass(frozen=True)
class ActiveKey:
    id: UUID
    prefix: str


@dataclass(frozen=True)
class KeyUsage:
    requests: int
    succeeded: int
    failed: int
    cancelled: int
    running: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    spent_usd: float
    held_usd: float


KEY_BY_HASH = Query(
    "key_by_hash",
    "select id, owner_id, name, key_hash, rpm_limit, tpm_limit, budget_usd, revoked_at is not null as revoked"
    " from public.api_keys where key_hash = %s",
    class_row(KeyRecord),
)
# Every change to api_keys is announced here (notify_api_key_change): gateways drop cached keys.
LISTEN_KEY_CHANGES = Query("listen_key_changes", "listen neuralgrid_api_keys", scalar_row)
CREATE_KEY = Query(
    "create_key",
    "select id, api_key, prefix from public.create_api_key(%s, %s::int, %s::int, %s::numeric)",
    class_row(CreatedKey),
)
# As the service this lists every key; as a signed-in user, RLS leaves their own.
LIST_KEYS = Query(
    "list_keys",
    "select id, name, prefix, rpm_limit, tpm_limit, budget_usd::float8 as budget_usd,"
    " spent_usd::float8 as spent_usd, created_at, last_used_at, revoked_at"
    " from public.api_keys order by created_at",
    dict_row,
)
ACTIVE_KEYS_MATCHING = Query(
    "active_keys_matching",
    "select id, prefix from public.api_keys where revoked_at is null and (id::text = %s or prefix = %s)",
    class_row(ActiveKey),
)
REVOKE_KEY = Query(
    "revoke_key",
    "update public.api_keys set revoked_at = now() where id = %s and revoked_at is null returning id",
    scalar_row,
)


KEY_USAGE = Query(
    "key_usage",
    """
select count(j.id) as requests, count(j.id) filter (where j.status = 'succeeded') as succeeded,
  count(j.id) filter (where j.status = 'failed') as failed,
  count(j.id) filter (where j.status = 'cancelled') as cancelled,
  count(j.id) filter (where j.status = 'running') as running,
  coalesce(sum(j.prompt_tokens), 0)::int8 as prompt_tokens,
  coalesce(sum(j.completion_tokens), 0)::int8 as completion_tokens,
  coalesce(sum(j.cost_usd), 0)::float8 as cost_usd,
  k.spent_usd::float8 as spent_usd, k.reserved_usd::float8 as held_usd
from public.api_keys k
left join public.jobs j on j.api_key_id = k.id and (%(user)s::text is null or j.end_user = %(user)s)
where k.id = %(key)s
group by k.id
""",
    class_row(KeyUsage),
)


# Keys the CLI creates for a user (`neuralgrid keys create --owner`).
# For the rest of the transaction, act as this signed-in user, as the API does (db/roles.py): what
# create_api_key() then creates, auth.uid() makes theirs.
ACT_AS_USER = Query(
    "act_as_user",
    "select set_config('role', 'authenticated', true), set_config('request.jwt.claims',"
    " json_build_object('role', 'authenticated', 'sub', %s::uuid)::text, true)",
    scalar_row,
)
# Supabase Auth keeps emails lower-case; an id is matched as text so that any string is a fair question.
USER_BY_ID_OR_EMAIL = Query(
    "user_by_id_or_email",
    "select id from auth.users where id::text = %(who)s or email = lower(%(who)s)",
    scalar_row,
)
