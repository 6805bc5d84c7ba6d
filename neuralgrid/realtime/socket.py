"""The WebSocket endpoint: one connection, its joined channels, and the events clients send."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import psycopg
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketState

from neuralgrid.realtime.auth import AuthError, verify
from neuralgrid.realtime.authz import Access
from neuralgrid.realtime.bindings import Binding, BindingError, parse_binding
from neuralgrid.realtime.fastpath import EXTENSION, FrameWriter
from neuralgrid.realtime.hub import PREFIX, Channel, Hub
from neuralgrid.realtime.limits import (
    MAX_NAME_CHARS,
    NAME_TOO_LONG,
    RATE_LIMITED,
    TOO_MANY_CHANNELS,
    Limits,
    Throttle,
    Verdict,
    too_large,
    too_many_presences,
)
from neuralgrid.realtime.protocol import V1, VERSIONS, Message, Outgoing, ProtocolError, decode, outgoing
from neuralgrid.server.deps import ServicesDep
from neuralgrid.server.tokens import TokenKeys

log = logging.getLogger(__name__)

router = APIRouter()

HEARTBEAT_TIMEOUT_S = 60.0  # clients heartbeat every 25-30 s; Phoenix drops a socket silent for 60
MAX_QUEUED = 10_000  # messages waiting for a socket that does not read; then it is dropped
MAX_FRAME_BYTES = 1_048_576  # not even decoded; Limits.max_message_bytes refuses smaller ones
POLICY_VIOLATION = 1008  # the WebSocket close code for a client that keeps breaking the limits


def _object(value: Any) -> dict[str, Any]:
    """A config section, or {} where a client sent nothing (or something that is not an object)."""
    return value if isinstance(value, dict) else {}


def unauthorized(sub_topic: str) -> str:
    return f"Unauthorized: You do not have permissions to read from this Channel topic: {sub_topic}"


def unauthorized_write(sub_topic: str) -> str:
    return f"Unauthorized: You do not have permissions to write to this Channel topic: {sub_topic}"


class Connection:
    """A client's socket: reads and handles its messages, and sends through the hub's coalesced frame
    writes (or, under another ASGI server, a queue drained by a writer task)."""

    def __init__(
        self, ws: WebSocket, hub: Hub, keys: TokenKeys, vsn: str, claims: dict[str, Any], limits: Limits
    ) -> None:
        self.ws = ws
        self.hub = hub
        self.keys = keys
        self.vsn = vsn
        self.claims = claims
        self.limits = limits
        self.throttle = Throttle(limits, time.monotonic())
        self.channels: dict[str, Channel] = {}
        # Served by our uvicorn protocol, frames go straight to the socket; under any other ASGI
        # server, through a queue and a writer task.
        extension = ws.scope.get("extensions", {}).get(EXTENSION)
        self.frames: FrameWriter | None = extension["writer"] if extension else None
        self.pending: list[bytes] = []  # frames waiting for the hub's next flush
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.overflowed = False

    def queue(self, message: Outgoing) -> None:
        if self.overflowed:
            return
        if self.frames is not None:
            self.pending.append(message.frame)
            if len(self.pending) == 1:
                self.hub.coalescer.mark(self)
        elif self.outbox.qsize() >= MAX_QUEUED:
            self._overflow()
        else:
            self.outbox.put_nowait(message.text)

    def flush(self) -> None:
        if not self.pending:
            return
        frames = b"".join(self.pending)
        self.pending.clear()
        if self.frames is not None and not self.overflowed and not self.frames.write(frames):
            self._overflow()

    def _overflow(self) -> None:
        self.overflowed = True
        log.warning("realtime: a subscriber stopped reading (or left); disconnecting it")
        self.outbox.put_nowait(None)

    def reply(self, msg: Message, status: str, response: dict[str, Any]) -> None:
        payload = {"status": status, "response": response}
        self.queue(outgoing(Message(msg.topic, "phx_reply", payload, msg.ref, msg.join_ref), self.vsn))

    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        try:
            while not writer.done():
                try:
                    async with asyncio.timeout(HEARTBEAT_TIMEOUT_S):
                        frame = await self.ws.receive()
                except TimeoutError:
                    log.info(
                        "realtime: closing a socket that sent no heartbeat for %.0fs", HEARTBEAT_TIMEOUT_S
                    )
                    break
                if frame["type"] == "websocket.disconnect":
                    break
                data = frame.get("text") if frame.get("text") is not None else frame.get("bytes")
                if data is None:
                    continue
                size = len(data.encode(errors="surrogatepass")) if isinstance(data, str) else len(data)
                verdict = self.throttle.admit(size, time.monotonic())
                if verdict is Verdict.CLOSE:
                    await self._close_for_abuse()
                    break
                if size > MAX_FRAME_BYTES:
                    self.queue(
                        outgoing(Message("phoenix", "phx_error", {"reason": "message too large"}), self.vsn)
                    )
                    continue
                try:
                    msg = decode(data, self.vsn)
                except ProtocolError as err:
                    log.info("realtime: dropped a malformed message: %s", err)
                    continue
                if verdict is Verdict.REFUSE:
                    self.reply(msg, "error", {"reason": RATE_LIMITED})
                    continue
                if size > self.limits.max_message_bytes:
                    self.reply(msg, "error", {"reason": too_large(size, self.limits.max_message_bytes)})
                    continue
                try:
                    await self.handle(msg, size)
                except RecursionError:
                    self.reply(msg, "error", {"reason": "the message is nested too deep"})
                except (psycopg.Error, UnicodeEncodeError) as err:
                    # The database is down or refused (or text it cannot hold): say so, keep the socket.
                    log.warning("realtime: %s %s failed: %s", msg.event, msg.topic, err)
                    self.reply(msg, "error", {"reason": "DatabaseError: the database could not answer"})
        except WebSocketDisconnect:
            pass
        finally:
            for channel in list(self.channels.values()):
                await self.hub.remove(channel)
            self.channels.clear()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            if self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await self.ws.close()

    async def _close_for_abuse(self) -> None:
        """A client still sending a whole bucket past its limit: it gets what is queued (its
        refusals), then a close, as Supabase shuts a channel that sends too many messages."""
        log.warning("realtime: closing a socket that kept sending past its rate limit")
        self.flush()
        with contextlib.suppress(Exception):
            await self.ws.close(code=POLICY_VIOLATION, reason=RATE_LIMITED)

    async def _write(self) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            while True:
                text = await self.outbox.get()
                if text is None:
                    return
                await self.ws.send_text(text)

    # -- events -----------------------------------------------------------------------------------

    async def handle(self, msg: Message, size: int) -> None:
        if msg.topic == "phoenix" and msg.event == "heartbeat":
            self.reply(msg, "ok", {})
            return
        if msg.event == "phx_join":
            await self.join(msg)
            return
        channel = self.channels.get(msg.topic)
        if channel is None:
            self.reply(msg, "error", {"reason": "unmatched topic"})
            return
        if msg.event == "phx_leave":
            self.reply(msg, "ok", {})
            await self.close_channel(channel)
        elif msg.event == "access_token":
            await self.refresh_token(channel, msg.payload.get("access_token"))
        elif msg.event == "broadcast":
            await self.client_broadcast(channel, msg)
        elif msg.event == "presence":
            await self.client_presence(channel, msg, size)
        else:
            self.reply(msg, "error", {"reason": f"unknown event {msg.event!r}"})

    async def join(self, msg: Message) -> None:
        if not msg.topic.startswith(PREFIX) or msg.topic == PREFIX:
            self.reply(msg, "error", {"reason": "TopicNameRequired: You must provide a topic name"})
            return
        if len(msg.topic) > len(PREFIX) + MAX_NAME_CHARS:
            self.reply(msg, "error", {"reason": NAME_TOO_LONG})
            return
        if msg.topic not in self.channels and len(self.channels) >= self.limits.max_channels:
            self.reply(msg, "error", {"reason": TOO_MANY_CHANNELS})
            return
        if (old := self.channels.pop(msg.topic, None)) is not None:
            await self.hub.remove(old)  # a rejoin replaces the channel, as in Phoenix
        token = msg.payload.get("access_token")
        if token is not None and not isinstance(token, str):
            self.reply(msg, "error", {"reason": "MalformedJWT: The token provided is not a valid JWT"})
            return
        try:
            claims = self.claims if not token or token.startswith("sb_") else await verify(token, self.keys)
        except AuthError as err:
            self.reply(msg, "error", {"reason": err.reason})
            return
        config = _object(msg.payload.get("config"))
        private = bool(config.get("private", False))
        broadcast, presence = _object(config.get("broadcast")), _object(config.get("presence"))
        presence_key = str(presence.get("key") or "") or str(uuid.uuid4())
        if len(presence_key) > MAX_NAME_CHARS:
            self.reply(msg, "error", {"reason": NAME_TOO_LONG})
            return
        sub_topic = msg.topic.removeprefix(PREFIX)
        if private:
            access = await self.hub.authz.topic_access(claims, sub_topic)
            if not access.read:
                self.reply(msg, "error", {"reason": unauthorized(sub_topic)})
                return
        else:
            access = self._public_access(sub_topic, claims)
        bindings: list[Binding] = []
        binding_errors: list[str] = []
        changes = config.get("postgres_changes") or []
        for raw in changes if isinstance(changes, list) else [changes]:
            try:
                bindings.append(parse_binding(raw))
            except BindingError as err:
                binding_errors.append(str(err))
        channel = Channel(
            self,
            msg.topic,
            msg.join_ref,
            claims,
            private=private,
            access=access,
            broadcast_self=bool(broadcast.get("self", False)),
            broadcast_ack=bool(broadcast.get("ack", False)),
            presence_enabled=bool(presence.get("enabled", False)),
            presence_key=presence_key,
            bindings=bindings,
        )
        self.channels[msg.topic] = channel
        await self.hub.add(channel)
        self._schedule_expiry(channel)
        self.reply(msg, "ok", {"postgres_changes": [b.reply() for b in bindings]})
        if bindings or binding_errors:
            await self._report_bindings(channel, bindings, binding_errors)
        if channel.presence_enabled:
            channel.send("presence_state", self.hub.presence_state(channel.room))

    def _public_access(self, sub_topic: str, claims: dict[str, Any]) -> Access:
        """Anyone reads a public topic and writes to it, but for the platform's own (the map):
        those only service_role writes, so no client can fake what the platform publishes."""
        writable = sub_topic not in self.limits.read_only_topics or claims.get("role") == "service_role"
        return Access(True, writable)

    async def _report_bindings(self, channel: Channel, bindings: list[Binding], errors: list[str]) -> None:
        for binding in bindings:
            if binding.table == "*" or binding.schema == "*":
                continue
            table = await self.hub.authz.table(binding.schema, binding.table)
            if table is None or not table.published:
                errors.append(
                    f"Unable to subscribe to changes with given parameters: {binding.schema}.{binding.table}"
                    " is not in the supabase_realtime publication"
                )
                continue
            # Such a filter matches nothing (the hub tests filters on what the subscriber sees): said.
            visible = await self.hub.authz.visible_columns(channel.claims["role"], table)
            for hidden in sorted({c.column for c in binding.conditions} - visible):
                errors.append(
                    f"Unable to subscribe to changes with given parameters: filter on {hidden}, which"
                    f" {channel.claims['role']} may not select on {binding.schema}.{binding.table}"
                )
        if errors:
            for error in errors:
                self._system(channel, "error", "postgres_changes", error)
        else:
            self._system(channel, "ok", "postgres_changes", "Subscribed to PostgreSQL")

    def _system(self, channel: Channel, status: str, extension: str, message: str) -> None:
        channel.send(
            "system",
            {"message": message, "status": status, "extension": extension, "channel": channel.sub_topic},
        )

    async def close_channel(self, channel: Channel, reason: str | None = None) -> None:
        """Ends a channel; with a reason, first says why in a system message (as Supabase does)."""
        if reason:
            self._system(channel, "error", "system", reason)
        channel.send("phx_close", {}, channel.join_ref)
        self.channels.pop(channel.topic, None)
        await self.hub.remove(channel)

    def _schedule_expiry(self, channel: Channel) -> None:
        if channel.expiry:
            channel.expiry.cancel()
        left = float(channel.claims["exp"]) - time.time()
        loop = asyncio.get_running_loop()
        channel.expiry = loop.call_later(max(left, 0), lambda: asyncio.ensure_future(self._expire(channel)))

    async def _expire(self, channel: Channel) -> None:
        if self.channels.get(channel.topic) is channel:
            late = int(time.time() - float(channel.claims["exp"]))
            await self.close_channel(channel, f"Token has expired {late} seconds ago")

    async def refresh_token(self, channel: Channel, token: Any) -> None:
        if not isinstance(token, str) or token.startswith("sb_"):
            return  # publishable keys are ignored, as on Supabase
        try:
            claims = await verify(token, self.keys)
        except AuthError as err:
            await self.close_channel(channel, err.reason)
            return
        channel.claims = claims
        if channel.private:
            channel.access = await self.hub.authz.topic_access(claims, channel.sub_topic)
            if not channel.access.read:
                await self.close_channel(channel, unauthorized(channel.sub_topic))
                return
        else:
            channel.access = self._public_access(channel.sub_topic, claims)
        self._schedule_expiry(channel)

    async def client_broadcast(self, channel: Channel, msg: Message) -> None:
        payload = msg.payload
        if not isinstance(payload.get("event"), str):
            if channel.broadcast_ack:
                self.reply(msg, "error", {"error": "broadcast needs an event name"})
            return
        if not channel.access.write:
            # Denied writes on private topics are silent unless acked, as on Supabase; a read-only
            # public topic always says why, or its clients could not tell a refusal from silence.
            if channel.broadcast_ack or not channel.private:
                self.reply(msg, "error", {"reason": unauthorized_write(channel.sub_topic)})
            return
        await self.hub.broadcast(
            channel, {"type": "broadcast", "event": payload["event"], "payload": payload.get("payload", {})}
        )
        if channel.broadcast_ack:
            self.reply(msg, "ok", {})

    async def client_presence(self, channel: Channel, msg: Message, size: int) -> None:
        event = msg.payload.get("event")
        if not channel.access.write:
            self.reply(msg, "error", {"reason": unauthorized_write(channel.sub_topic)})
            return
        if event == "track":
            meta = msg.payload.get("payload")
            if not isinstance(meta, dict):
                self.reply(msg, "error", {"reason": "Presence track payload must be a map"})
                return
            if refusal := self._presence_refusal(channel, size):
                self.reply(msg, "error", {"reason": refusal})
                return
            channel.presence_enabled = True
            await self.hub.track(channel, meta)
        elif event == "untrack":
            await self.hub.untrack(channel)
        else:
            self.reply(msg, "error", {"reason": f"unknown presence event {event!r}"})
            return
        self.reply(msg, "ok", {})

    def _presence_refusal(self, channel: Channel, size: int) -> str | None:
        """Why a track cannot be kept (it stays in the memory of every instance that shows it)."""
        if size > self.limits.max_presence_bytes:
            return too_large(size, self.limits.max_presence_bytes)
        if channel.presence_ref is None:  # a new presence, not a replacement of this channel's own
            tracking = sum(1 for c in self.channels.values() if c.presence_ref is not None)
            if tracking >= self.limits.max_presences:
                return too_many_presences(self.limits.max_presences)
        return None


@router.websocket("/realtime/v1/websocket")
async def realtime_websocket(ws: WebSocket, services: ServicesDep) -> None:
    hub, keys = services.realtime, services.tokens
    apikey = ws.query_params.get("apikey") or ws.headers.get("apikey") or ""
    vsn = ws.query_params.get("vsn") or V1
    try:
        if hub.off:
            raise AuthError("RealtimeDisabled", hub.off)
        if vsn not in VERSIONS:
            raise AuthError("UnsupportedProtocolVersion", f"vsn {vsn!r}: use one of {VERSIONS}")
        claims = await verify(apikey, keys)
    except AuthError as err:
        log.info("realtime: refused a connection: %s", err.reason)
        await ws.close(code=1008, reason=err.reason[:120])  # before accept: an HTTP 403
        return
    await ws.accept()
    await Connection(ws, hub, keys, vsn, claims, Limits.from_settings(services.settings)).run()
