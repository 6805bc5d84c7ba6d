"""Who a Realtime subscriber is: the claims of its JWT, checked as Supabase Realtime checks them."""

from __future__ import annotations

import math
import time
from typing import Any

import jwt

from neuralgrid.server.tokens import KEY_ROLES, NotAJwt, TokenKeyError, TokenKeys

# The roles a token may act as. A signed token naming any other role (postgres, say) is refused
# rather than trusted: Realtime runs its checks with SET ROLE to this value.
API_ROLES = frozenset({"anon", "authenticated", "service_role"})


class AuthError(Exception):
    """A token Realtime refuses; `reason` is the `<Code>: <message>` string clients receive."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def reason(self) -> str:
        return str(self)


# A claim set for an opaque API key (sb_publishable_…, sb_secret_…): the role it stands for, and an
# expiry an hour ahead, renewed by nothing (a key does not expire; a socket that outlives the hour
# sends an access_token, as supabase-js does, or reconnects).
API_KEY_CLAIMS_S = 3600


async def verify(token: str | None, keys: TokenKeys, now: float | None = None) -> dict[str, Any]:
    if not token:
        raise AuthError("Unauthorized", "an apikey or access_token is required")
    if token.startswith(tuple(KEY_ROLES)):
        role = keys.role_of_api_key(token)
        if role is None:
            raise AuthError("Unauthorized", "unknown API key")
        return {"role": role, "exp": int(time.time() if now is None else now) + API_KEY_CLAIMS_S}
    try:
        found = await keys.for_token(token)
    except NotAJwt as err:
        raise AuthError("MalformedJWT", "The token provided is not a valid JWT") from err
    except TokenKeyError as err:
        raise AuthError("JwtSignatureError", f"Failed to validate JWT signature: {err}") from err
    try:
        claims: dict[str, Any] = jwt.decode(
            token, found.key, algorithms=[found.algorithm], options={"verify_exp": False, "verify_aud": False}
        )
    except jwt.InvalidSignatureError as err:
        raise AuthError("JwtSignatureError", "Failed to validate JWT signature") from err
    except jwt.PyJWTError as err:
        raise AuthError("MalformedJWT", "The token provided is not a valid JWT") from err
    if "role" not in claims or "exp" not in claims:
        raise AuthError("InvalidJWTToken", "Fields `role` and `exp` are required in JWT")
    if not isinstance(claims["role"], str) or claims["role"] not in API_ROLES:
        raise AuthError("Unauthorized", f"role {claims['role']!r} is not an API role")
    exp = claims["exp"]
    try:
        finite = not isinstance(exp, bool) and isinstance(exp, int | float) and math.isfinite(float(exp))
    except OverflowError:
        finite = False
    if not finite:
        raise AuthError("InvalidJWTToken", "Field `exp` must be a number")
    left = float(exp) - (time.time() if now is None else now)
    if left <= 0:
        raise AuthError("InvalidJWTExpiration", f"Token has expired {int(-left)} seconds ago")
    return claims
