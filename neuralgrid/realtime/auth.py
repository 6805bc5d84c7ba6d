"""Who a Realtime subscriber is: the claims of its JWT, checked as Supabase Realtime checks them."""

from __future__ import annotations

import math
import time
from typing import Any

import jwt

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


def verify(token: str | None, secret: str, now: float | None = None) -> dict[str, Any]:
    if not token:
        raise AuthError("Unauthorized", "an apikey or access_token is required")
    try:
        claims: dict[str, Any] = jwt.decode(
            token, secret, algorithms=["HS256"], options={"verify_exp": False, "verify_aud": False}
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
