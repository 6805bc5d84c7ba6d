"""One settings object for the whole platform, read from the environment (and `.env`)."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PLACEHOLDER_SECRET = "change-me-to-a-long-random-secret"


class Settings(BaseSettings):
    """Every knob, with its environment variable. `.env.example` documents each one."""

    # Only the aliases are read: a field's own name (`home`, `port`) would match HOME or PORT.
    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=False)

    environment: Literal["development", "production"] = Field("development", alias="NEURALGRID_ENV")
    home: Path = Field(Path("~/.neuralgrid"), alias="NEURALGRID_HOME")
    database_url: str | None = Field(None, alias="DATABASE_URL")
    db_port: int = Field(54322, alias="NEURALGRID_DB_PORT", ge=1, le=65535)
    db_pool_size: int = Field(16, alias="NEURALGRID_DB_POOL_SIZE", ge=1)
    # Connections for the request path (match, failover, completions). Small on purpose: requests
    # contend for the same few node rows, and connections beyond what the database runs at once
    # only queue on those locks inside Postgres (measured: more connections, fewer requests/s).
    request_pool_size: int = Field(4, alias="NEURALGRID_REQUEST_POOL_SIZE", ge=1)
    sweep_interval_s: float = Field(1.0, alias="NEURALGRID_SWEEP_INTERVAL_S", gt=0)
    # Agents' heartbeats are written in one statement this often (or every half heartbeat interval,
    # if that is less): see gateway/heartbeats.py. 0: each beat at once, one statement a beat.
    heartbeat_flush_s: float = Field(1.0, alias="NEURALGRID_HEARTBEAT_FLUSH_S", ge=0, le=60)

    # Slots leased from Postgres and spent here, jobs written behind (docs/scaling.md#far-from-the-
    # database-leases); off: every request is placed in SQL, one round trip. Records not yet written
    # wait in the spool folder (unset: <NEURALGRID_HOME>/spool), where a gateway that dies leaves them
    # for the next one started on this machine.
    leases: bool = Field(True, alias="NEURALGRID_LEASES")
    spool_dir: Path | None = Field(None, alias="NEURALGRID_SPOOL_DIR")

    host: str = Field("127.0.0.1", alias="NEURALGRID_HOST")
    port: int = Field(8080, alias="NEURALGRID_PORT", ge=1, le=65535)
    jwt_secret: str = Field(PLACEHOLDER_SECRET, alias="NEURALGRID_JWT_SECRET")
    redis_url: str | None = Field(None, alias="REDIS_URL")

    # A request that finds every capable node busy waits for a slot, in a line per model (fair
    # across keys) of at most queue_max_waiting requests, for at most queue_timeout_s; then 503.
    queue_timeout_s: float = Field(30.0, alias="NEURALGRID_QUEUE_TIMEOUT_S", ge=0)
    queue_max_waiting: int = Field(256, alias="NEURALGRID_QUEUE_MAX_WAITING", ge=0)
    max_attempts: int = Field(3, alias="NEURALGRID_MAX_ATTEMPTS", ge=1, le=10)
    connect_timeout_s: float = Field(2.0, alias="NEURALGRID_CONNECT_TIMEOUT_S", gt=0)
    first_byte_timeout_s: float = Field(30.0, alias="NEURALGRID_FIRST_BYTE_TIMEOUT_S", gt=0)
    # A stream a node drops after its first byte goes on on another node, which is sent the
    # conversation plus the text streamed so far (see proxy.continuation).
    resume_streams: bool = Field(True, alias="NEURALGRID_RESUME_STREAMS")
    max_body_bytes: int = Field(1_048_576, alias="NEURALGRID_MAX_BODY_BYTES", ge=1024)
    # A node's whole (non-streamed) answer is read before it is passed on (its usage is metered
    # first): past this it is a failure of the node's, not a gateway out of memory.
    max_answer_bytes: int = Field(64 << 20, alias="NEURALGRID_MAX_ANSWER_BYTES", ge=1 << 20)
    # A request body must arrive within this (headers within 10 s: see server/serving.py), so that
    # clients sending a byte now and then cannot hold sockets and memory.
    body_timeout_s: float = Field(30.0, alias="NEURALGRID_BODY_TIMEOUT_S", gt=0)
    key_cache_ttl_s: float = Field(30.0, alias="NEURALGRID_KEY_CACHE_TTL_S", ge=0)
    default_max_tokens: int = Field(512, alias="NEURALGRID_DEFAULT_MAX_TOKENS", ge=1)
    # Servers that cannot keep keys' prompt caches apart (llama.cpp's, unlike vLLM's and SGLang's):
    # "strip" keeps their cache and strips its counts from answers (a cached prompt's timing still
    # shows); "off" asks llama-server to skip its cache for every request. See gateway/prompt_cache.py.
    shared_cache: Literal["strip", "off"] = Field("strip", alias="NEURALGRID_SHARED_CACHE")
    # Model verification (gateway/verifier.py): the referee that scores challenges (python -m
    # neuralgrid.verify.referee, holding the reference GGUFs). Unset: this gateway sends no challenges.
    referee_url: str | None = Field(None, alias="NEURALGRID_REFEREE_URL")
    # Challenges this gateway has under way at once (the referee scores one at a time).
    challenges_in_flight: int = Field(2, ge=1, le=64, alias="NEURALGRID_CHALLENGES_IN_FLIGHT")
    # The share of greedy chat answers (temperature 0, nothing else that changes the answer) scored
    # after delivery as challenges are: a node that tells challenges from traffic still gains nothing.
    audit_share: float = Field(0.05, ge=0, le=1, alias="NEURALGRID_AUDIT_SHARE")
    # Where no referee of this gateway holds a pinned model's artifact (a Hugging Face revision, a GGUF
    # it lacks), its nodes are challenged against each other (verify/agreement.py).
    cross_checks: bool = Field(True, alias="NEURALGRID_CROSS_CHECKS")
    # GPU probes (gateway/gpu_prober.py): this gateway takes its share of the nodes due one (each
    # checks a few blocks on this CPU, some 0.3 s for 2 MiB blocks).
    gpu_probes: bool = Field(True, alias="NEURALGRID_GPU_PROBES")
    # The share of one claimed GPU's memory a probe fills: more proves more, and costs the node more.
    gpu_probe_fill_share: float = Field(0.5, gt=0, le=0.9, alias="NEURALGRID_GPU_PROBE_FILL_SHARE")
    # The request path's transactions (claims, completions: jobs, node load and reputation, budget
    # holds and charges) commit without waiting for the WAL flush (synchronous_commit = off). A
    # Postgres crash may lose the last fraction of a second of them, never corrupt them. Creating and
    # revoking keys, registering nodes and everything else commit durably.
    async_commit: bool = Field(True, alias="NEURALGRID_ASYNC_COMMIT")
    # Node endpoints on loopback, private or link-local addresses: fine for a demo on one machine, an
    # open door to internal services in production (the gateway would POST to them). None: allowed
    # in development only.
    allow_private_endpoints: bool | None = Field(None, alias="NEURALGRID_ALLOW_PRIVATE_ENDPOINTS")
    # A hosted Supabase project for the web UI (Realtime and email sign-in); unset on the embedded
    # stack, where the gateway itself serves both.
    supabase_url: str | None = Field(None, alias="NEURALGRID_SUPABASE_URL")
    supabase_anon_key: str | None = Field(None, alias="NEURALGRID_SUPABASE_ANON_KEY")
    # Where the project publishes its asymmetric signing keys (ES256/RS256 user tokens). Unset: the
    # project's own JWKS when NEURALGRID_SUPABASE_URL is set, else none (HS256 tokens only).
    jwks_url: str | None = Field(None, alias="NEURALGRID_JWKS_URL", pattern=r"^https?://\S+$")
    # What one Realtime socket may send (see docs/realtime.md#limits): message sizes, a message and a
    # byte rate (token buckets of two and four seconds' worth), channels and presences at once, and
    # public topics only the platform (and service_role) writes to. A JSON list in the environment.
    realtime_max_message_bytes: int = Field(65_536, alias="NEURALGRID_REALTIME_MAX_MESSAGE_BYTES", ge=1024)
    realtime_max_presence_bytes: int = Field(8_192, alias="NEURALGRID_REALTIME_MAX_PRESENCE_BYTES", ge=256)
    realtime_events_per_s: float = Field(100.0, alias="NEURALGRID_REALTIME_EVENTS_PER_S", gt=0)
    realtime_bytes_per_s: float = Field(262_144.0, alias="NEURALGRID_REALTIME_BYTES_PER_S", gt=0)
    realtime_max_channels: int = Field(100, alias="NEURALGRID_REALTIME_MAX_CHANNELS", ge=1)
    realtime_max_presences: int = Field(10, alias="NEURALGRID_REALTIME_MAX_PRESENCES", ge=1)
    realtime_read_only_topics: list[str] = Field(
        ["node-map", "map:summary"], alias="NEURALGRID_REALTIME_READ_ONLY_TOPICS"
    )

    # Several gateways on one database (docs/scaling.md). Where the other gateways reach this one to
    # forward requests for the tunnels it holds; unset: http://<host>:<port> (the machine's name
    # when the gateway listens on every address).
    internal_url: str | None = Field(None, alias="NEURALGRID_INTERNAL_URL", pattern=r"^https?://\S+$")
    # The secret every gateway derives its keys from (all must share it): the key it signs forwarded
    # requests with, and each node's request key (platform_key()). Unset: NEURALGRID_JWT_SECRET.
    internal_secret: str | None = Field(None, alias="NEURALGRID_INTERNAL_SECRET")
    # LISTEN (key changes, freed slots, the Realtime feed) and the sweeper need a session of their
    # own: behind a transaction-mode pooler, point this at a session-mode one. Unset: DATABASE_URL.
    session_database_url: str | None = Field(None, alias="NEURALGRID_SESSION_DATABASE_URL")
    # DATABASE_URL is a transaction-mode pooler (pgbouncer pool_mode=transaction, Supavisor's
    # transaction port): no server-side prepared statements, no session settings (so the request
    # path commits durably whatever NEURALGRID_ASYNC_COMMIT says).
    transaction_pooler: bool = Field(False, alias="NEURALGRID_DB_TRANSACTION_POOLER")

    def platform_key(self, label: bytes) -> bytes:
        """A key of the gateways' own for one use (`label`), from NEURALGRID_INTERNAL_SECRET, else
        NEURALGRID_JWT_SECRET: every gateway derives the same, and no key reveals another."""
        secret = self.internal_secret or self.jwt_secret
        return hmac.new(secret.encode(), label, hashlib.sha256).digest()

    @property
    def spool(self) -> Path:
        return (self.spool_dir or self.home / "spool").expanduser()

    @property
    def signing_keys_url(self) -> str | None:
        """The JWKS user tokens are verified with, besides the JWT secret."""
        if self.jwks_url or not self.supabase_url:
            return self.jwks_url
        return self.supabase_url.rstrip("/") + "/auth/v1/.well-known/jwks.json"

    @property
    def private_endpoints_allowed(self) -> bool:
        if self.allow_private_endpoints is None:
            return self.environment == "development"
        return self.allow_private_endpoints

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.environment != "development":
            if self.jwt_secret == PLACEHOLDER_SECRET:
                raise ValueError("NEURALGRID_JWT_SECRET is still the placeholder: set a real secret")
            if len(self.jwt_secret) < 32:
                raise ValueError("NEURALGRID_JWT_SECRET must be at least 32 characters")
            if self.internal_secret is not None and len(self.internal_secret) < 32:
                raise ValueError("NEURALGRID_INTERNAL_SECRET must be at least 32 characters")
        if (self.supabase_url is None) != (self.supabase_anon_key is None):
            raise ValueError("set NEURALGRID_SUPABASE_URL and NEURALGRID_SUPABASE_ANON_KEY together")
        self.home = self.home.expanduser().absolute()  # Postgres runs in pgdata: relative paths break
        return self

    @property
    def embedded(self) -> bool:
        """True when no DATABASE_URL is given and the platform runs its own Postgres."""
        return not self.database_url
