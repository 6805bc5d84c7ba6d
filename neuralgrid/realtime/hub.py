"""The Realtime hub of one gateway instance: joined channels, the Postgres feed, fan-out, presence.

Every instance LISTENs on the `realtime` NOTIFY channel. Database changes and realtime.messages come
from triggers (realtime_feed.sql); client broadcasts and presence changes are sent there too (with
the sending instance's id, which skips its own), so subscribers on any instance see everything.
Deliveries of one feed message are encoded once per (protocol version, topic, payload view) and
handed to each subscriber's socket, whose writes the Coalescer batches; a subscriber that stops
reading is disconnected, not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import uuid
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg_pool import AsyncConnectionPool

from neuralgrid.realtime.authz import Access, Authorizer, Table
from neuralgrid.realtime.bindings import Binding
from neuralgrid.realtime.fastpath import Coalescer
from neuralgrid.realtime.protocol import Message, Outgoing, outgoing

log = logging.getLogger(__name__)

PREFIX = "realtime:"
FEED_CHANNEL = "realtime"
RECONNECT_S = (0.2, 0.5, 1.0, 2.0, 5.0)
WATCH_REFRESH_S = 30.0
WATCH = (
    "insert into realtime.feed_subscriptions (relid, instance) select unnest(%s::oid[]), %s"
    " on conflict (relid, instance) do update set seen_at = now()"
)
UNWATCH = "delete from realtime.feed_subscriptions where relid = any(%s::oid[]) and instance = %s"


class Sink(Protocol):
    """A subscriber's socket as the hub sees it."""

    vsn: str

    def queue(self, message: Outgoing) -> None: ...


class Channel:
    """One topic joined on one socket."""

    def __init__(
        self,
        sink: Sink,
        topic: str,
        join_ref: str | None,
        claims: dict[str, Any],
        *,
        private: bool,
        access: Access,
        broadcast_self: bool,
        broadcast_ack: bool,
        presence_enabled: bool,
        presence_key: str,
        bindings: list[Binding],
    ) -> None:
        self.sink = sink
        self.topic = topic
        self.sub_topic = topic.removeprefix(PREFIX)
        self.join_ref = join_ref
        self.claims = claims
        self.private = private
        self.access = access
        self.broadcast_self = broadcast_self
        self.broadcast_ack = broadcast_ack
        self.presence_enabled = presence_enabled
        self.presence_key = presence_key
        self.presence_ref: str | None = None  # phx_ref of what this channel tracks
        self.bindings = bindings
        self.relids: list[int] = []  # the published tables its bindings cover
        self.expiry: asyncio.TimerHandle | None = None

    @property
    def room(self) -> tuple[str, bool]:
        # Public and private channels of one name are apart, as on Supabase.
        return (self.sub_topic, self.private)

    def send(self, event: str, payload: Any, ref: str | None = None) -> None:
        self.sink.queue(outgoing(Message(self.topic, event, payload, ref, self.join_ref), self.sink.vsn))


def commit_timestamp(value: str) -> str:
    """Postgres' timestamptz as JSON (2026-11-21T10:00:00.123456+00:00) the way Supabase prints it."""
    moment = datetime.fromisoformat(value)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class Hub:
    def __init__(self, pool: AsyncConnectionPool, database_url: str) -> None:
        self.pool = pool
        self.database_url = database_url
        self.authz = Authorizer(pool)
        self.instance = uuid.uuid4().hex
        self.rooms: dict[tuple[str, bool], set[Channel]] = defaultdict(set)
        # room -> presence key -> phx_ref -> (meta with phx_ref, owning instance)
        self.presence: dict[tuple[str, bool], dict[str, dict[str, tuple[dict[str, Any], str]]]] = defaultdict(
            lambda: defaultdict(dict)
        )
        self.watched: dict[int, int] = defaultdict(int)  # relid -> local channels watching it
        self.coalescer = Coalescer()
        self.listening = asyncio.Event()

    # -- channels ---------------------------------------------------------------------------------

    async def add(self, channel: Channel) -> None:
        """Registers a channel; its postgres_changes tables are watched before this returns, so a
        change committed after the join reply reaches it."""
        self.rooms[channel.room].add(channel)
        if channel.bindings:
            channel.relids = await self._published_relids(channel.bindings)
            fresh = [relid for relid in channel.relids if not self.watched[relid]]
            for relid in channel.relids:
                self.watched[relid] += 1
            if fresh:
                async with self.pool.connection() as conn:
                    await conn.execute(WATCH, (fresh, self.instance))

    async def remove(self, channel: Channel) -> None:
        if channel.expiry:
            channel.expiry.cancel()
        room = self.rooms.get(channel.room)
        if room is not None and channel in room:
            room.discard(channel)
            if not room:
                del self.rooms[channel.room]
            unwatched = []
            for relid in channel.relids:
                self.watched[relid] -= 1
                if not self.watched[relid]:
                    del self.watched[relid]
                    unwatched.append(relid)
            if unwatched:
                async with self.pool.connection() as conn:
                    await conn.execute(UNWATCH, (unwatched, self.instance))
        if channel.presence_ref:
            await self.untrack(channel)

    async def _published_relids(self, bindings: list[Binding]) -> list[int]:
        async with self.pool.connection() as conn:
            rows = await (
                await conn.execute(
                    "select distinct format('%I.%I', schemaname, tablename)::regclass::oid::int8,"
                    " schemaname, tablename from pg_publication_tables where pubname = 'supabase_realtime'"
                )
            ).fetchall()
        return [
            relid
            for relid, schema, table in rows
            if any(b.schema in ("*", schema) and b.table in ("*", table) for b in bindings)
        ]

    async def _keep_watching(self) -> None:
        """Refreshes this instance's watched tables (rows older than 90 s stop counting)."""
        while True:
            await asyncio.sleep(WATCH_REFRESH_S)
            if self.watched:
                with contextlib.suppress(psycopg.Error):
                    async with self.pool.connection() as conn:
                        await conn.execute(WATCH, (list(self.watched), self.instance))

    def channels(self) -> Iterable[Channel]:
        for room in self.rooms.values():
            yield from room

    # -- broadcast --------------------------------------------------------------------------------

    async def broadcast(self, sender: Channel, payload: dict[str, Any]) -> None:
        """A client's broadcast: to this instance's subscribers now, to the others through Postgres."""
        self._deliver_broadcast(sender.room, payload, skip=None if sender.broadcast_self else sender)
        await self._notify(
            {"k": "broadcast", "topic": sender.sub_topic, "private": sender.private, "payload": payload}
        )

    def _deliver_broadcast(
        self, room: tuple[str, bool], payload: dict[str, Any], skip: Channel | None = None
    ) -> None:
        cache: dict[tuple[str, str], Outgoing] = {}
        for channel in list(self.rooms.get(room, ())):
            if channel is skip or (channel.private and not channel.access.read):
                continue
            key = (channel.sink.vsn, channel.topic)
            message = cache.get(key)
            if message is None:
                message = cache[key] = outgoing(
                    Message(channel.topic, "broadcast", payload), channel.sink.vsn
                )
            channel.sink.queue(message)

    # -- presence ---------------------------------------------------------------------------------

    def presence_state(self, room: tuple[str, bool]) -> dict[str, Any]:
        return {
            key: {"metas": [meta for meta, _ in metas.values()]}
            for key, metas in self.presence.get(room, {}).items()
            if metas
        }

    async def track(self, channel: Channel, meta: dict[str, Any]) -> None:
        leaves = self._drop_local(channel)
        ref = secrets.token_urlsafe(12)
        entry = {**meta, "phx_ref": ref}
        if leaves:
            entry["phx_ref_prev"] = leaves[channel.presence_key]["metas"][0]["phx_ref"]
        self.presence[channel.room][channel.presence_key][ref] = (entry, self.instance)
        channel.presence_ref = ref
        joins = {channel.presence_key: {"metas": [entry]}}
        self._deliver_presence_diff(channel.room, joins, leaves)
        await self._notify_presence(channel.room, joins, leaves)

    async def untrack(self, channel: Channel) -> None:
        leaves = self._drop_local(channel)
        if leaves:
            self._deliver_presence_diff(channel.room, {}, leaves)
            await self._notify_presence(channel.room, {}, leaves)

    def _drop_local(self, channel: Channel) -> dict[str, Any]:
        if channel.presence_ref is None:
            return {}
        metas = self.presence[channel.room][channel.presence_key]
        entry, _ = metas.pop(channel.presence_ref, ({}, ""))
        if not metas:
            del self.presence[channel.room][channel.presence_key]
        channel.presence_ref = None
        return {channel.presence_key: {"metas": [entry]}} if entry else {}

    def _apply_remote_presence(
        self, room: tuple[str, bool], joins: dict[str, Any], leaves: dict[str, Any], origin: str
    ) -> None:
        for key, value in leaves.items():
            for meta in value.get("metas", []):
                self.presence[room][key].pop(meta.get("phx_ref"), None)
            if not self.presence[room][key]:
                del self.presence[room][key]
        for key, value in joins.items():
            for meta in value.get("metas", []):
                self.presence[room][key][meta["phx_ref"]] = (meta, origin)
        self._deliver_presence_diff(room, joins, leaves)

    def _deliver_presence_diff(
        self, room: tuple[str, bool], joins: dict[str, Any], leaves: dict[str, Any]
    ) -> None:
        payload = {"joins": joins, "leaves": leaves}
        for channel in list(self.rooms.get(room, ())):
            if channel.presence_enabled and (not channel.private or channel.access.read):
                channel.send("presence_diff", payload)

    async def _announce_presence(self) -> None:
        """Tell a newly started instance what this one tracks."""
        for room, keys in list(self.presence.items()):
            joins = {
                key: {"metas": [m for m, origin in metas.values() if origin == self.instance]}
                for key, metas in keys.items()
            }
            joins = {k: v for k, v in joins.items() if v["metas"]}
            if joins:
                await self._notify_presence(room, joins, {})

    async def _notify_presence(
        self, room: tuple[str, bool], joins: dict[str, Any], leaves: dict[str, Any]
    ) -> None:
        topic, private = room
        await self._notify(
            {"k": "presence", "topic": topic, "private": private, "joins": joins, "leaves": leaves}
        )

    # -- the feed ---------------------------------------------------------------------------------

    async def _notify(self, message: dict[str, Any]) -> None:
        message["origin"] = self.instance
        async with self.pool.connection() as conn:
            await conn.execute("select realtime.feed_notify(%s::jsonb)", (json.dumps(message),))

    async def run(self, stop: asyncio.Event) -> None:
        """LISTEN until stopped, reconnecting with backoff (changes while disconnected are lost)."""
        keeper = asyncio.create_task(self._keep_watching())
        try:
            await self._listen(stop)
        finally:
            keeper.cancel()
            with contextlib.suppress(psycopg.Error):
                async with self.pool.connection() as conn:
                    await conn.execute(
                        "delete from realtime.feed_subscriptions where instance = %s", (self.instance,)
                    )

    async def _listen(self, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
                    await conn.execute(f"listen {FEED_CHANNEL}")
                    self.listening.set()
                    attempt = 0
                    await self._notify({"k": "hello"})
                    gen = conn.notifies()
                    stopper = asyncio.ensure_future(stop.wait())
                    try:
                        while not stop.is_set():
                            nxt = asyncio.ensure_future(anext(gen))
                            done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
                            if nxt not in done:
                                nxt.cancel()
                                break
                            await self._handle(nxt.result().payload)
                    finally:
                        stopper.cancel()
            except (psycopg.Error, OSError) as err:
                self.listening.clear()
                delay = RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)]
                attempt += 1
                log.warning("realtime feed lost (%s); reconnecting in %.1fs", err, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)

    async def _handle(self, text: str) -> None:
        try:
            message = json.loads(text)
            if message.get("k") == "overflow":
                async with self.pool.connection() as conn:
                    row = await (
                        await conn.execute(
                            "select payload from realtime.feed_overflow where id = %s", (message["id"],)
                        )
                    ).fetchone()
                if row is None:
                    return
                message = row[0]
            await self._dispatch(message)
        except Exception:  # one bad notification must not stop the feed
            log.exception("realtime: could not deliver a feed message")

    async def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("k")
        if message.get("origin") == self.instance:
            return
        if kind == "change":
            await self._deliver_change(message)
        elif kind == "message" and message.get("extension") == "broadcast":
            payload = {
                "type": "broadcast",
                "event": message.get("event"),
                "payload": message.get("payload"),
                "meta": {"id": message.get("id")},
            }
            self._deliver_broadcast((message["topic"], bool(message.get("private"))), payload)
        elif kind == "broadcast":
            self._deliver_broadcast((message["topic"], bool(message["private"])), message["payload"])
        elif kind == "presence":
            room = (message["topic"], bool(message["private"]))
            self._apply_remote_presence(
                room, message.get("joins", {}), message.get("leaves", {}), message["origin"]
            )
        elif kind == "hello":
            await self._announce_presence()

    # -- postgres_changes ---------------------------------------------------------------------------

    async def _deliver_change(self, change: dict[str, Any]) -> None:
        schema, name, kind = change["schema"], change["table"], change["type"]
        record, old = change.get("record"), change.get("old_record")
        subscribed: list[tuple[Channel, list[int]]] = []
        for channel in list(self.channels()):
            ids = [b.id for b in channel.bindings if b.matches(schema, name, kind, record)]
            if ids:
                subscribed.append((channel, ids))
        if not subscribed:
            return
        table = await self.authz.table(schema, name)
        if table is None or not table.published:
            return
        stamp = commit_timestamp(change["commit_timestamp"])
        # One RLS check and one payload per distinct subscriber identity, not per subscriber.
        views: dict[str, dict[str, Any] | None] = {}
        cache: dict[tuple[str, str, str, tuple[int, ...]], Outgoing] = {}
        for channel, ids in subscribed:
            identity = json.dumps(channel.claims, sort_keys=True)
            if identity not in views:
                views[identity] = await self._view(channel.claims, table, kind, record, old, stamp)
            data = views[identity]
            if data is None:
                continue
            key = (channel.sink.vsn, channel.topic, identity, tuple(ids))
            message = cache.get(key)
            if message is None:
                message = cache[key] = outgoing(
                    Message(channel.topic, "postgres_changes", {"ids": ids, "data": data}), channel.sink.vsn
                )
            channel.sink.queue(message)

    async def _view(
        self,
        claims: dict[str, Any],
        table: Table,
        kind: str,
        record: dict[str, Any] | None,
        old: dict[str, Any] | None,
        stamp: str,
    ) -> dict[str, Any] | None:
        """The change as this subscriber may see it, or None: only columns it may select, and only
        rows its policies let it select (deletes are not checked: the row is gone, as on Supabase)."""
        visible = await self.authz.visible_columns(claims["role"], table)
        if not visible:
            return None
        if (
            kind != "DELETE"
            and record is not None
            and not await self.authz.row_visible(claims, table, record)
        ):
            return None
        # Without REPLICA IDENTITY FULL the old row carries only its primary key, as in the WAL.
        old_columns = visible if table.replica_identity_full else visible & set(table.primary_key)
        return {
            "schema": table.schema,
            "table": table.name,
            "commit_timestamp": stamp,
            "type": kind,
            "columns": [{"name": n, "type": t} for n, t in table.columns if n in visible],
            "record": {k: v for k, v in (record or {}).items() if k in visible},
            "old_record": {k: v for k, v in (old or {}).items() if k in old_columns},
            "errors": None,
        }
