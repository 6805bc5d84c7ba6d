"""Users' tokens as Supabase Auth issues them now: ES256 or RS256 from the project's signing keys
(published as a JWKS), HS256 from the legacy JWT secret; and Supabase's opaque API keys on Realtime.

The JWKS is served by a real HTTP server on loopback that counts its requests, so caching and
rotation are observed from outside, as Supabase's Auth would see them.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import jwt
import psycopg
import pytest
import websockets
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from neuralgrid.server.tokens import parse_jwks, stack_api_keys
from tests.conftest import make_user

SECRET = "test-secret-of-the-project-0123456789abcdef"


@dataclass
class Jwks:
    """A project's signing keys, served at `url`; `fetches` counts the GETs."""

    url: str = ""
    keys: dict[str, Any] = field(default_factory=dict)  # kid -> private key
    published: list[str] = field(default_factory=list)  # the kids in the document
    fetches: int = 0

    def add(self, kid: str, algorithm: str) -> None:
        private: Any = (
            ec.generate_private_key(ec.SECP256R1())
            if algorithm == "ES256"
            else rsa.generate_private_key(public_exponent=65537, key_size=2048)
        )
        self.keys[kid] = (private, algorithm)
        self.published.append(kid)

    def document(self) -> dict[str, Any]:
        out = []
        for kid in self.published:
            private, algorithm = self.keys[kid]
            writer = ECAlgorithm if algorithm == "ES256" else RSAAlgorithm
            jwk = json.loads(writer.to_jwk(private.public_key()))
            out.append({**jwk, "kid": kid, "alg": algorithm, "use": "sig", "key_ops": ["verify"]})
        return {"keys": out}

    def token(self, kid: str, user: uuid.UUID, **claims: Any) -> str:
        private, algorithm = self.keys[kid]
        return jwt.encode(user_claims(user, **claims), private, algorithm=algorithm, headers={"kid": kid})


def user_claims(user: uuid.UUID, **claims: Any) -> dict[str, Any]:
    return {
        "sub": str(user),
        "role": "authenticated",
        "aud": "authenticated",
        "exp": int(time.time()) + 300,
        **claims,
    }


@pytest.fixture
def jwks() -> Iterator[Jwks]:
    served = Jwks()
    served.add("es-1", "ES256")
    served.add("rs-1", "RS256")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.fetches += 1
            body = json.dumps(served.document()).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    served.url = f"http://127.0.0.1:{server.server_address[1]}/auth/v1/.well-known/jwks.json"
    yield served
    server.shutdown()
    server.server_close()


@pytest.fixture
def gateway_settings(jwks: Jwks) -> dict[str, Any]:
    return {"NEURALGRID_JWT_SECRET": SECRET, "NEURALGRID_JWKS_URL": jwks.url}


def keys_of(gateway: str, token: str) -> httpx.Response:
    return httpx.get(f"{gateway}/v1/keys", headers={"authorization": f"Bearer {token}"})


def test_es256_rs256_and_hs256_users_are_all_signed_in_and_the_jwks_is_read_once(
    conn: psycopg.Connection, gateway: str, jwks: Jwks
) -> None:
    user = make_user(conn)
    legacy = jwt.encode(user_claims(user), SECRET, algorithm="HS256")
    for token in (jwks.token("es-1", user), jwks.token("rs-1", user), legacy):
        resp = httpx.post(
            f"{gateway}/v1/keys", json={"name": "k"}, headers={"authorization": f"Bearer {token}"}
        )
        assert resp.status_code == 201, resp.text
    for _ in range(5):
        assert len(keys_of(gateway, jwks.token("es-1", user)).json()["data"]) == 3
    assert jwks.fetches == 1  # cached, not fetched per request


def test_a_rotated_in_key_is_fetched_and_made_up_key_ids_do_not_flood_auth(
    conn: psycopg.Connection, gateway: str, jwks: Jwks
) -> None:
    user = make_user(conn)
    assert keys_of(gateway, jwks.token("es-1", user)).status_code == 200
    jwks.add("es-2", "ES256")  # the project rotates: a new key, published, then signing
    assert keys_of(gateway, jwks.token("es-2", user)).status_code == 200
    assert jwks.fetches == 2
    jwks.add("es-3", "ES256")
    jwks.published.remove("es-3")  # a key the project never published
    for _ in range(10):
        resp = keys_of(gateway, jwks.token("es-3", user))
        assert resp.status_code == 401 and "es-3" in resp.json()["error"]["message"], resp.text
    assert jwks.fetches == 2  # looked again at most once per 30 s: not at all this soon after


def test_forged_and_confused_tokens_are_refused(conn: psycopg.Connection, gateway: str, jwks: Jwks) -> None:
    user = make_user(conn)
    ec_public_pem = (
        jwks.keys["es-1"][0]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    stranger = ec.generate_private_key(ec.SECP256R1())
    header, payload, _ = jwks.token("es-1", user).split(".")
    forged = [
        jwt.encode(user_claims(user), "", algorithm="none"),  # unsigned
        jwt.encode(user_claims(user), stranger, algorithm="ES256", headers={"kid": "es-1"}),  # wrong key
        # The public key used as an HMAC secret (algorithm confusion): PyJWT refuses a PEM as an
        # HMAC key, so the signature is made by hand.
        _hs256_with(ec_public_pem, user, kid="es-1"),
        jwks.token("es-1", user, aud="somebody-else"),
        jwks.token("es-1", user, exp=int(time.time()) - 5),
        f"{header}.{payload}.AAAA",  # a truncated signature
        jwt.encode(  # an RS256 header on the EC key's id
            user_claims(user),
            jwks.keys["rs-1"][0],
            algorithm="RS256",
            headers={"kid": "es-1"},
        ),
    ]
    for token in forged:
        resp = keys_of(gateway, token)
        assert resp.status_code == 401, (token, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error" or resp.json()["error"]["message"]


def _hs256_with(secret: bytes, user: uuid.UUID, kid: str) -> str:
    import base64
    import hashlib
    import hmac

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode().rstrip("=")

    signing_input = f"{b64(json.dumps({'alg': 'HS256', 'typ': 'JWT', 'kid': kid}).encode())}.{b64(json.dumps(user_claims(user)).encode())}"
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(signature)}"


@pytest.mark.parametrize("gateway_settings", [{"NEURALGRID_JWT_SECRET": SECRET}])
def test_without_a_jwks_an_asymmetric_token_is_refused_and_says_why(
    conn: psycopg.Connection, gateway: str, jwks: Jwks
) -> None:
    resp = keys_of(gateway, jwks.token("es-1", make_user(conn)))
    assert resp.status_code == 401 and "no JWKS is configured" in resp.json()["error"]["message"]


async def test_realtime_takes_signing_key_tokens_and_the_stacks_opaque_keys(
    conn: psycopg.Connection, gateway: str, jwks: Jwks
) -> None:
    base = gateway.replace("http://", "ws://") + "/realtime/v1/websocket?vsn=1.0.0&apikey="
    keys = stack_api_keys(SECRET)
    user = make_user(conn)
    for apikey in (keys["sb_publishable_"], keys["sb_secret_"], jwks.token("es-1", user, role="anon")):
        async with websockets.connect(base + apikey) as ws:
            join = {
                "topic": "realtime:t",
                "event": "phx_join",
                "ref": "1",
                "payload": {"config": {}, "access_token": jwks.token("rs-1", user)},
            }
            await ws.send(json.dumps(join))
            reply = json.loads(await ws.recv())
            assert reply["payload"]["status"] == "ok", reply
    for refused in (
        "sb_publishable_not-this-stacks",
        stack_api_keys("another-secret-0123456789abcdefgh")["sb_secret_"],
    ):
        with pytest.raises(websockets.InvalidStatus) as err:
            await websockets.connect(base + refused)
        assert err.value.response.status_code == 403


def test_a_jwks_yields_only_public_signing_keys() -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    public = json.loads(ECAlgorithm.to_jwk(ec_key.public_key()))
    private = json.loads(ECAlgorithm.to_jwk(ec_key))
    document = {
        "keys": [
            {**public, "kid": "good", "alg": "ES256"},
            {**public, "kid": "no-alg"},  # alg inferred from kty, as Supabase's keys always say it anyway
            {**private, "kid": "private", "alg": "ES256"},
            {**public, "kid": "encryption", "alg": "ES256", "use": "enc"},
            {**public, "kid": "mislabelled", "alg": "RS256"},
            {"kid": "broken", "kty": "EC", "alg": "ES256", "crv": "P-256", "x": "AAAA", "y": "AAAA"},
            {**public, "kid": "hs", "alg": "HS256"},
            "not a key",
        ]
    }
    assert sorted(parse_jwks(document)) == ["good", "no-alg"]
    with pytest.raises(ValueError):
        parse_jwks({"keys": "none"})
