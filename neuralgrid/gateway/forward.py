"""The gateway holding a tunnel: the route the other gateways forward requests to, for a node whose
agent dialled this gateway. Signed by a gateway, or refused; answered in frames. gateway/peers.py is
the asking side and says what the frames are and why the route is neither an open relay nor a way in.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import AsyncIterator
from uuid import UUID

from fastapi import APIRouter, Request
from starlette.responses import StreamingResponse

from neuralgrid.gateway.body import read_body
from neuralgrid.gateway.errors import BadRequest, GatewayError, Unauthorized
from neuralgrid.gateway.peers import DATA, END, FRAMES, JSON, PREFIX, START, StatusLine, failure_frame, frame
from neuralgrid.gateway.pipeline.kinds import PATHS
from neuralgrid.gateway.tunnel import Tunnel
from neuralgrid.gateway.upstream import NodeError
from neuralgrid.protocol import signing
from neuralgrid.protocol.tunnel import is_content_type
from neuralgrid.server.deps import ServicesDep

FORWARDED_PATHS = frozenset(PATHS.values())  # only inference reaches an agent this way
MAX_WAIT_S = 3600.0  # the longest wait for a node's status line an asking gateway may ask for

router = APIRouter(prefix=PREFIX, tags=["internal"], include_in_schema=False)


class Misdirected(GatewayError):
    """This gateway does not hold the tunnel (any more): the asking gateway moves the job on."""

    status, type, code = 421, "invalid_request_error", "misdirected_request"


@router.post("/{holder}/tunnels/{node_id}/{path:path}")
async def forwarded(
    holder: UUID, node_id: UUID, path: str, request: Request, services: ServicesDep
) -> StreamingResponse:
    """A request another gateway placed on a node whose tunnel this gateway holds; the node's answer
    goes back in frames. Signed by a gateway, or refused."""
    settings, peers = services.settings, services.peers
    body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    signature = request.headers.get(signing.HEADER)
    signed = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if not peers.verifier.verify(peers.key, signature, signed, body):
        raise Unauthorized("this route takes requests signed by the platform's gateways only")
    timeout_s = _wait(request.query_params.get("first_byte_timeout_s"), settings.first_byte_timeout_s)
    target = "/" + path
    if target not in FORWARDED_PATHS:
        raise BadRequest(f"{target} is not forwarded to nodes", param="path")
    if holder != services.tunnels.gateway_id:  # meant for another gateway (or an old address of ours)
        raise Misdirected(f"this is not gateway {holder}")
    link = services.tunnels.get(node_id)
    if link is None:
        raise Misdirected(f"this gateway does not hold node {node_id}'s tunnel")
    content_type = _content_type(request.query_params.get("content_type"))
    if content_type == JSON:  # an upload's bytes travel in base64 over the tunnel; JSON as text
        try:
            body.decode()
        except UnicodeDecodeError:
            raise BadRequest("the request body is not UTF-8") from None
    return StreamingResponse(_relay(link, target, body, timeout_s, content_type), media_type=FRAMES)


def _content_type(given: str | None) -> str:
    """The body's content type, as the asking gateway gave it (URL-safe base64); JSON by default."""
    if given is None:
        return JSON
    try:
        content_type = base64.urlsafe_b64decode(given.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        content_type = ""
    if not is_content_type(content_type):
        raise BadRequest("content_type must be a header value in URL-safe base64", param="content_type")
    return content_type


def _wait(given: str | None, default: float) -> float:
    """How long the asking gateway waits for the node's status line (its default: this gateway's)."""
    if given is None:
        return default
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_WAIT_S:  # NaN fails this too
        raise BadRequest(f"first_byte_timeout_s must be a number of seconds in (0, {MAX_WAIT_S:g}]")
    return seconds


async def _relay(
    link: Tunnel, path: str, body: bytes, first_byte_timeout_s: float, content_type: str
) -> AsyncIterator[bytes]:
    """The node's answer over the tunnel, in frames; the asking gateway leaving cancels it."""
    try:
        resp = await link.request(path, body, content_type)
    except NodeError as err:
        yield failure_frame(err)
        return
    try:
        try:
            await resp.start(first_byte_timeout_s)
        except NodeError as err:
            yield failure_frame(err)
            return
        yield frame(START, StatusLine(status=resp.status, type=resp.content_type).model_dump_json().encode())
        try:
            async for chunk in resp.chunks():
                yield frame(DATA, chunk)
        except NodeError as err:
            yield failure_frame(err)
            return
        yield frame(END)
    finally:
        await resp.close()
