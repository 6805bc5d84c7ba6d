"""Which key verifies a Supabase JWT: the project's legacy JWT secret (HS256), or one of the
asymmetric signing keys (ES256, RS256) it publishes at `/auth/v1/.well-known/jwks.json`; and which
role an opaque Supabase API key (`sb_publishable_…`, `sb_secret_…`) stands for.

The key set is cached: fetched on first use, again after `ttl_s` (Supabase's edge caches it for ten
minutes, so a new key is announced well before it signs), and at once when a token names a key id
the cache lacks (a rotation), though no more than once per `refetch_s`, so that tokens with made-up
key ids cannot turn the gateway into a load generator against Auth. Callers decode with the key and
algorithm given here and keep their own claim checks (audience, expiry) and their own errors.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

# The algorithms Supabase Auth signs with. Each is bound to the kind of key that may verify it, so a
# token cannot pick its own: "HS256" with a public key as the secret, say, or "none".
ASYMMETRIC = {"ES256": "EC", "RS256": "RSA"}
SYMMETRIC = "HS256"


# Supabase's opaque API keys stand for a role, as the legacy anon and service_role JWTs did.
KEY_ROLES = {"sb_publishable_": "anon", "sb_secret_": "service_role"}


def stack_api_keys(secret: str) -> dict[str, str]:
    """The embedded stack's publishable and secret keys, derived from its JWT secret (so that they
    survive restarts and change with it), in Supabase's format."""
    keys = {}
    for prefix in KEY_ROLES:
        digest = hmac.new(secret.encode(), f"neuralgrid {prefix}".encode(), hashlib.sha256).digest()
        keys[prefix] = prefix + base64.urlsafe_b64encode(digest[:24]).decode().rstrip("=")
    return keys


class TokenKeyError(Exception):
    """No key verifies this token: its header is unreadable, its algorithm is not accepted, or its
    key id is not in the project's key set."""


class NotAJwt(TokenKeyError):
    """The token is not a JWT at all (its header does not decode)."""


@dataclass(frozen=True)
class Verification:
    """What to decode a token with: `jwt.decode(token, key, algorithms=[algorithm])`."""

    key: Any
    algorithm: str


class TokenKeys:
    """The keys a deployment accepts: the JWT secret always (the embedded stack and legacy projects
    sign with it), and a project's JWKS when `jwks_url` is set; `api_keys` are the opaque keys
    accepted where Supabase accepts them (the Realtime socket's `apikey`)."""

    def __init__(
        self,
        secret: str,
        jwks_url: str | None = None,
        *,
        api_keys: tuple[str, ...] = (),
        ttl_s: float = 600.0,
        refetch_s: float = 30.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.secret = secret
        self.jwks_url = jwks_url
        self.ttl_s = ttl_s
        self.refetch_s = refetch_s
        self._http = http
        self._roles = {
            k: role for k in api_keys for prefix, role in KEY_ROLES.items() if k.startswith(prefix)
        }
        self._keys: dict[str, Verification] = {}
        self._looked_for_kid = -float("inf")  # when a token's unknown key id last caused a fetch
        self._fresh_until = -float("inf")
        self._lock = asyncio.Lock()

    def role_of_api_key(self, apikey: str) -> str | None:
        """The role an opaque API key stands for; None for a key this deployment did not issue."""
        given = apikey.encode(errors="surrogatepass")
        for known, role in self._roles.items():
            if hmac.compare_digest(known.encode(), given):
                return role
        return None

    async def for_token(self, token: str) -> Verification:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as err:
            raise NotAJwt(f"not a JWT: {err}") from err
        alg, kid = header.get("alg"), header.get("kid")
        if alg == SYMMETRIC:
            return Verification(self.secret, SYMMETRIC)
        if alg not in ASYMMETRIC:
            raise TokenKeyError(f"tokens signed with {alg!r} are not accepted (HS256, ES256 or RS256)")
        if self.jwks_url is None:
            raise TokenKeyError(f"an {alg} token, but no JWKS is configured (NEURALGRID_SUPABASE_URL)")
        if not isinstance(kid, str):
            raise TokenKeyError(f"an {alg} token without a key id (kid)")
        now = time.monotonic()
        if now >= self._fresh_until or (
            kid not in self._keys and now - self._looked_for_kid >= self.refetch_s
        ):
            await self._refresh(kid)
        found = self._keys.get(kid)
        if found is None:
            raise TokenKeyError(f"key id {kid!r} is not in the project's signing keys")
        if found.algorithm != alg:
            raise TokenKeyError(f"key {kid!r} is an {found.algorithm} key, the token says {alg}")
        return found

    async def _refresh(self, kid: str) -> None:
        async with self._lock:
            now = time.monotonic()
            stale = now >= self._fresh_until
            if not stale and (kid in self._keys or now - self._looked_for_kid < self.refetch_s):
                return  # another caller fetched while this one waited
            if not stale:
                self._looked_for_kid = now
            try:
                keys = await self._fetch()
            except (httpx.HTTPError, ValueError) as err:
                # Keep the keys already known (Auth being briefly unreachable must not sign everyone
                # out), and try again no sooner than refetch_s.
                self._fresh_until = now + self.refetch_s
                if not self._keys:
                    raise TokenKeyError(f"the project's signing keys could not be read: {err}") from err
                return
            self._keys = keys
            self._fresh_until = now + self.ttl_s

    async def _fetch(self) -> dict[str, Verification]:
        assert self.jwks_url is not None
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=5.0)
        response = await self._http.get(self.jwks_url, headers={"accept": "application/json"})
        response.raise_for_status()
        return parse_jwks(response.json())

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def parse_jwks(document: Any) -> dict[str, Verification]:
    """The verifying keys of a JWKS document by key id; keys for other uses or algorithms are skipped
    (a set may hold keys this gateway has no use for)."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError("a JWKS document is an object with a 'keys' list")
    found: dict[str, Verification] = {}
    for jwk in document["keys"]:
        if not isinstance(jwk, dict) or not isinstance(jwk.get("kid"), str):
            continue
        alg = jwk.get("alg") or {"EC": "ES256", "RSA": "RS256"}.get(str(jwk.get("kty")))
        if alg not in ASYMMETRIC or jwk.get("kty") != ASYMMETRIC[alg] or jwk.get("use", "sig") != "sig":
            continue
        reader = ECAlgorithm if alg == "ES256" else RSAAlgorithm
        try:
            key = reader.from_jwk(json.dumps(jwk))
        except (jwt.PyJWTError, ValueError, KeyError, TypeError):
            continue  # a malformed key verifies nothing; the others still do
        if hasattr(key, "sign"):
            continue  # a private key has no business in a public key set
        found[jwk["kid"]] = Verification(key, alg)
    return found
