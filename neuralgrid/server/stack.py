"""The stack's credentials, as `supabase status` shows them: the JWT secret and the two API keys.

On the embedded stack the secret is generated once and kept in `NEURALGRID_HOME/jwt-secret` (mode
0600), unless NEURALGRID_JWT_SECRET sets one; on a Supabase project set NEURALGRID_JWT_SECRET to the
project's JWT secret. The `anon` and `service_role` keys are long-lived JWTs signed with it, exactly
the shape of Supabase's legacy API keys, so supabase-js and the `realtime` client accept them.
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import jwt

from neuralgrid.server.settings import PLACEHOLDER_SECRET, Settings

TEN_YEARS_S = 10 * 365 * 24 * 3600


def secret_file(settings: Settings) -> Path:
    return settings.home / "jwt-secret"


def with_stack_secret(settings: Settings) -> Settings:
    """Settings whose jwt_secret is the stack's: the configured one, else (embedded) the one kept
    under home. With DATABASE_URL and no secret set, the development placeholder stays."""
    if settings.jwt_secret != PLACEHOLDER_SECRET or not settings.embedded:
        return settings
    path = secret_file(settings)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48))
    return settings.model_copy(update={"jwt_secret": path.read_text().strip()})


def api_key(secret: str, role: Literal["anon", "service_role"]) -> str:
    """A Supabase-style API key: a JWT with the role and a far expiry, no user."""
    now = int(time.time())
    return jwt.encode(
        {"iss": "neuralgrid", "role": role, "iat": now, "exp": now + TEN_YEARS_S}, secret, algorithm="HS256"
    )


def user_token(secret: str, user_id: uuid.UUID | str, email: str | None, ttl_s: int = 3600) -> str:
    """An access token for a signed-in user, the shape Supabase Auth issues (HS256, aud authenticated)."""
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": "neuralgrid",
        "aud": "authenticated",
        "sub": str(user_id),
        "role": "authenticated",
        "iat": now,
        "exp": now + ttl_s,
    }
    if email:
        claims["email"] = email
    return jwt.encode(claims, secret, algorithm="HS256")


def public_base_url(settings: Settings) -> str:
    """Where clients reach the gateway (a wildcard bind address is reached on loopback)."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


def status(settings: Settings, database_url: str) -> dict[str, str]:
    """What `neuralgrid status` prints: URLs and keys, as `supabase status` does."""
    if settings.supabase_url and settings.supabase_anon_key:  # a hosted Supabase project
        api, anon = settings.supabase_url.rstrip("/"), settings.supabase_anon_key
    else:
        api, anon = public_base_url(settings), api_key(settings.jwt_secret, "anon")
    gateway = public_base_url(settings)
    return {
        "API_URL": f"{gateway}/v1",
        "MAP_URL": f"{gateway}/",
        "REALTIME_URL": f"{api.replace('http', 'ws', 1)}/realtime/v1",
        "DB_URL": database_url,
        "JWT_SECRET": settings.jwt_secret,
        "ANON_KEY": anon,
        "SERVICE_ROLE_KEY": api_key(settings.jwt_secret, "service_role"),
    }
