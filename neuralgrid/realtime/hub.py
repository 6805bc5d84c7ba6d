"""The Realtime hub of one gateway instance: joined channels, the Postgres feed, fan-out, presence.

Every instance LISTENs on the `realtime` NOTIFY channel. Database changes and realtime.messages come
from triggers (realtime_feed.sql); client broadcasts and presence changes are sent there too (with
the sending instance's id, which skips its own), so subscribers on any instance see everything.
Deliveries of one feed message are encoded once per (protocol version, topic, payload view) and
handed to each subscriber's socket, whose writes the Coalescer batches; a subscriber that stops
reading is disconnected, not waited for.

Client broadcasts and presence go to Postgres only for rooms another instance has subscribers in:
each instance announces the rooms it holds (`room` when one opens or closes, `rooms` in answer to a
`hello`), so a topic nobody else watches costs no NOTIFY and no overflow row, and presence lives only
in the instances that have a subscriber to show it to.

What the hub asks of Postgres, and the feed's connection, are in realtime/sql.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg_pool import AsyncConnectionPool

from neuralgrid.realtime import sql
from neuralgrid.realtime.authz import Access, Authorizer, Table
from neuralgrid.realtime.bindings import Binding
from neuralgrid.realtime.fastpath import Coalescer
from neuralgrid.realtime.protocol import Message, Outgoing, outgoing

log = logging.getLogger(__name__)

PREFIX = "realtime:"
RECONNECT_S = (0.2, 0.5, 1.0, 2.0, 5.0)
WATCH_REFRESH_S = 30.0  # also how often client overflow rows are pruned
# After (re)connecting to the feed, client events go to every instance until the others have
# answered our hello with the rooms they hold (they answer within milliseconds).
PEER_ANSWER_S = 1.0
BYE_S = 1.0  # on shutdown, how long telling the other gateways this one leaves may take
ROOMS_PER_NOTIFY_CHARS = 6000  # a `rooms` announcement stays a plain NOTIFY, never an overflow row
# realtime.feed_notify() parks payloads of 7,900 bytes and more (as jsonb prints them, which is not
# quite as json.dumps does) in realtime.feed_overflow and keeps them an hour; client events matter
# only until every instance has read them, so the hub prunes those itself once it may have parked one.
MAY_OVERFLOW_CHARS = 3900
CLIENT_OVERFLOW_KEEP_S = 120.0


Room = tuple[str, bool]  # (sub-topic, private)
Presence = dict[str, dict[str, tuple[dict[str, Any], str]]]  # key -> phx_ref -> (meta, owning instance)


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
    def room(self) -> Room:
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
        self.rooms: dict[Room, set[Channel]] = defaultdict(set)
        # Only rooms with a local channel: metas with phx_ref, tracked here or on another instance.
        self.presence: dict[Room, Presence] = {}
        self.watched: dict[int, int] = defaultdict(int)  # relid -> local channels watching it
        self.peer_rooms: dict[str, set[Room]] = {}  # another instance -> rooms it has subscribers in
        self.remote_interest: dict[Room, int] = {}  # room -> how many other instances hold it
        self.announced: set[Room] = set()  # the rooms the others were told we hold
        self._announcing = asyncio.Lock()  # announcements leave in the order the rooms changed
        self.forward_all_until = 0.0  # time.monotonic() until which client events go everywhere
        self.parked_at: float | None = None  # when a client event last may have overflowed
        self.coalescer = Coalescer()
        self.listening = asyncio.Event()
        # Why this gateway serves no Realtime (its feed is not installed on this database); None: on.
        self.off: str | None = None

    # -- channels ---------------------------------------------------------------------------------

    async def add(self, channel: Channel) -> None:
        """Registers a channel; its postgres_changes tables are watched before this returns, so a
        change committed after the join reply reaches it."""
        self.rooms[channel.room].add(channel)
        await self._announce_room(channel.room)
        if channel.bindings:
            channel.relids = await self._published_relids(channel.bindings)
            fresh = [relid for relid in channel.relids if not self.watched[relid]]
            for relid in channel.relids:
                self.watched[relid] += 1
            if fresh:
                await sql.run(self.pool, sql.WATCH_TABLES, (fresh, self.instance))

    async def remove(self, channel: Channel) -> None:
        if channel.expiry:
            channel.expiry.cancel()
        room = self.rooms.get(channel.room, set())
        member = channel in room
        room.discard(channel)
        if channel.presence_ref:
            await self.untrack(channel)
        if not member:
            return
        if not room:
            del self.rooms[channel.room]
            self.presence.pop(channel.room, None)  # nobody here to show it to; the others resend on rejoin
            with contextlib.suppress(psycopg.Error):  # a leaving socket must not stop on it
                await self._announce_room(channel.room)
        unwatched = []
        for relid in channel.relids:
            self.watched[relid] -= 1
            if not self.watched[relid]:
                del self.watched[relid]
                unwatched.append(relid)
        if unwatched:
            await sql.run(self.pool, sql.UNWATCH_TABLES, (unwatched, self.instance))

    async def _published_relids(self, bindings: list[Binding]) -> list[int]:
        return [
            table.relid
            for table in await sql.run(self.pool, sql.PUBLISHED_TABLES)
            if any(b.schema in ("*", table.schema) and b.table in ("*", table.name) for b in bindings)
        ]

    async def _upkeep(self) -> None:
        """Refreshes this instance's watched tables (rows older than 90 s stop counting), and prunes
        the client events it parked in realtime.feed_overflow once they are old enough."""
        while True:
            await asyncio.sleep(WATCH_REFRESH_S)
            with contextlib.suppress(psycopg.Error):
                if self.watched:
                    await sql.run(self.pool, sql.WATCH_TABLES, (list(self.watched), self.instance))
                if self._parked_recently():
                    await sql.run(self.pool, sql.PRUNE_CLIENT_OVERFLOW, (CLIENT_OVERFLOW_KEEP_S,))

    def _parked_recently(self) -> bool:
        return (
            self.parked_at is not None
            and time.monotonic() - self.parked_at < CLIENT_OVERFLOW_KEEP_S + 2 * WATCH_REFRESH_S
        )

    def channels(self) -> Iterable[Channel]:
        for room in self.rooms.values():
            yield from room

    # -- broadcast --------------------------------------------------------------------------------

    async def broadcast(self, sender: Channel, payload: dict[str, Any]) -> None:
        """A client's broadcast: to this instance's subscribers now, to the others through Postgres
        when some other instance holds the room."""
        self._deliver_broadcast(sender.room, payload, skip=None if sender.broadcast_self else sender)
        if self.wanted_elsewhere(sender.room):
            await self._notify(
                {"k": "broadcast", "topic": sender.sub_topic, "private": sender.private, "payload": payload}
            )

    def _deliver_broadcast(self, room: Room, payload: dict[str, Any], skip: Channel | None = None) -> None:
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

    def presence_state(self, room: Room) -> dict[str, Any]:
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
        self.presence.setdefault(channel.room, {}).setdefault(channel.presence_key, {})[ref] = (
            entry,
            self.instance,
        )
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
        metas = self.presence.get(channel.room, {}).get(channel.presence_key, {})
        entry, _ = metas.pop(channel.presence_ref, ({}, ""))
        self._prune_presence(channel.room, channel.presence_key)
        channel.presence_ref = None
        return {channel.presence_key: {"metas": [entry]}} if entry else {}

    def _prune_presence(self, room: Room, key: str) -> None:
        """Drops a key without metas, then a room without keys: nothing stays for a topic left empty."""
        keys = self.presence.get(room)
        if keys is None:
            return
        if not keys.get(key, True):
            del keys[key]
        if not keys:
            del self.presence[room]

    def _apply_remote_presence(
        self, room: Room, joins: dict[str, Any], leaves: dict[str, Any], origin: str
    ) -> None:
        if room not in self.rooms:
            return  # no subscriber here: keep nothing (the others resend when one joins)
        keys = self.presence.setdefault(room, {})
        for key, value in leaves.items():
            metas = keys.get(key)
            if metas is not None:
                for meta in value.get("metas", []):
                    metas.pop(meta.get("phx_ref"), None)
                if not metas:
                    del keys[key]
        for key, value in joins.items():
            for meta in value.get("metas", []):
                keys.setdefault(key, {})[meta["phx_ref"]] = (meta, origin)
        if not keys:
            del self.presence[room]
        self._deliver_presence_diff(room, joins, leaves)

    def _deliver_presence_diff(self, room: Room, joins: dict[str, Any], leaves: dict[str, Any]) -> None:
        payload = {"joins": joins, "leaves": leaves}
        for channel in list(self.rooms.get(room, ())):
            if channel.presence_enabled and (not channel.private or channel.access.read):
                channel.send("presence_diff", payload)

    def _local_presence(self, room: Room) -> dict[str, Any]:
        """What this instance tracks in a room, as presence joins."""
        joins = {
            key: {"metas": [meta for meta, origin in metas.values() if origin == self.instance]}
            for key, metas in self.presence.get(room, {}).items()
        }
        return {key: value for key, value in joins.items() if value["metas"]}

    async def _notify_presence(
        self, room: Room, joins: dict[str, Any], leaves: dict[str, Any], to: str | None = None
    ) -> None:
        """To the instance `to`, or to all when some other instance holds the room."""
        if to is None and not self.wanted_elsewhere(room):
            return
        topic, private = room
        message = {"k": "presence", "topic": topic, "private": private, "joins": joins, "leaves": leaves}
        if to is not None:
            message["to"] = to
        await self._notify(message)

    # -- rooms held across instances ----------------------------------------------------------------

    def wanted_elsewhere(self, room: Room) -> bool:
        """Whether another instance may have a subscriber in `room` (O(1): a client event's check)."""
        return room in self.remote_interest or time.monotonic() < self.forward_all_until

    async def _announce_room(self, room: Room) -> None:
        """Tells the others whether this instance holds `room` now. The state is read and sent under
        a lock, so when a join and a leave race, the last announcement they get is the true one."""
        async with self._announcing:
            held = room in self.rooms
            if held == (room in self.announced):
                return
            topic, private = room
            await self._notify({"k": "room", "topic": topic, "private": private, "open": held})
            if held:
                self.announced.add(room)
            else:
                self.announced.discard(room)

    async def _announce_rooms(self) -> None:
        """Every room this instance holds, in NOTIFYs small enough never to overflow."""
        async with self._announcing:
            batch: list[list[Any]] = []
            size = 0
            for topic, private in list(self.announced):
                batch.append([topic, private])
                size += len(topic) + 16
                if size >= ROOMS_PER_NOTIFY_CHARS:
                    await self._notify({"k": "rooms", "rooms": batch})
                    batch, size = [], 0
            if batch:
                await self._notify({"k": "rooms", "rooms": batch})

    async def _peer_opened(self, origin: str, room: Room) -> None:
        rooms = self.peer_rooms.setdefault(origin, set())
        if room in rooms:
            return
        rooms.add(room)
        self.remote_interest[room] = self.remote_interest.get(room, 0) + 1
        if joins := self._local_presence(room):  # its new subscriber's presence_state lacks ours
            await self._notify_presence(room, joins, {}, to=origin)

    def _peer_closed(self, origin: str, room: Room) -> None:
        rooms = self.peer_rooms.get(origin)
        if rooms is None or room not in rooms:
            return
        rooms.discard(room)
        self.remote_interest[room] -= 1
        if not self.remote_interest[room]:
            del self.remote_interest[room]

    def _forget_peer(self, origin: str) -> None:
        for room in list(self.peer_rooms.get(origin, ())):
            self._peer_closed(origin, room)
        self.peer_rooms.pop(origin, None)

    # -- the feed ---------------------------------------------------------------------------------

    async def _notify(self, message: dict[str, Any]) -> None:
        message["origin"] = self.instance
        text = json.dumps(message)
        if len(text) >= MAY_OVERFLOW_CHARS and message["k"] in ("broadcast", "presence"):
            self.parked_at = time.monotonic()
        await sql.run(self.pool, sql.FEED_NOTIFY, (text,))

    async def run(self, stop: asyncio.Event) -> None:
        """LISTEN until stopped, reconnecting with backoff (changes while disconnected are lost)."""
        keeper = asyncio.create_task(self._upkeep())
        try:
            await self._listen(stop)
        finally:
            keeper.cancel()
            # Bounded: with the database away, the pool would wait its whole timeout for a connection.
            with contextlib.suppress(psycopg.Error, TimeoutError):
                await asyncio.wait_for(self._goodbye(), BYE_S)

    async def _goodbye(self) -> None:
        await self._notify({"k": "bye"})  # the others stop sending us this instance's rooms
        await sql.run(self.pool, sql.UNWATCH_ALL, (self.instance,))

    async def _listen(self, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            try:
                async with sql.feed(self.database_url) as gen:
                    self.forward_all_until = time.monotonic() + PEER_ANSWER_S
                    self.listening.set()
                    attempt = 0
                    await self._notify({"k": "hello"})
                    await self._announce_rooms()  # announcements missed while disconnected
                    stopper = asyncio.ensure_future(stop.wait())
                    nxt: asyncio.Future[psycopg.Notify] | None = None
                    try:
                        while not stop.is_set():
                            nxt = asyncio.ensure_future(anext(gen))
                            done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
                            if nxt not in done:
                                break
                            await self._handle(nxt.result().payload)
                    finally:
                        stopper.cancel()
                        if nxt is not None and not nxt.done():  # ended before the feed closes
                            nxt.cancel()
                            await asyncio.wait({nxt})
                            if not nxt.cancelled():
                                nxt.exception()  # read: the connection broke as it stopped
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
                message = await sql.first(self.pool, sql.OVERFLOW_PAYLOAD, (message["id"],))
                if message is None:
                    return
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
            if message.get("to", self.instance) != self.instance:
                return
            room = (message["topic"], bool(message["private"]))
            self._apply_remote_presence(
                room, message.get("joins", {}), message.get("leaves", {}), message["origin"]
            )
        elif kind == "room":
            room = (message["topic"], bool(message["private"]))
            if message.get("open"):
                await self._peer_opened(message["origin"], room)
            else:
                self._peer_closed(message["origin"], room)
        elif kind == "rooms":
            for topic, private in message.get("rooms", []):
                await self._peer_opened(message["origin"], (topic, bool(private)))
        elif kind == "hello":  # a new (or reconnected) instance: its rooms follow; tell it ours
            self._forget_peer(message["origin"])
            await self._announce_rooms()
        elif kind == "bye":
            self._forget_peer(message["origin"])

    # -- postgres_changes ---------------------------------------------------------------------------

    async def _deliver_change(self, change: dict[str, Any]) -> None:
        schema, name, kind = change["schema"], change["table"], change["type"]
        record, old = change.get("record"), change.get("old_record")
        # A first pass on the whole row finds the channels that may want the change (cheap; a filter
        # that fails on it fails on less of it too).
        subscribed: list[tuple[Channel, list[Binding]]] = []
        for channel in list(self.channels()):
            bindings = [b for b in channel.bindings if b.matches(schema, name, kind, record)]
            if bindings:
                subscribed.append((channel, bindings))
        if not subscribed:
            return
        table = await self.authz.table(schema, name)
        if table is None or not table.published:
            return
        stamp = commit_timestamp(change["commit_timestamp"])
        # One RLS check and one payload per distinct subscriber identity, not per subscriber.
        views: dict[str, dict[str, Any] | None] = {}
        cache: dict[tuple[str, str, str, tuple[int, ...]], Outgoing] = {}
        for channel, bindings in subscribed:
            identity = json.dumps(channel.claims, sort_keys=True)
            if identity not in views:
                views[identity] = await self._view(channel.claims, table, kind, record, old, stamp)
            data = views[identity]
            if data is None:
                continue
            # Filters are tested on what the subscriber may see: one on a column it may not select
            # would say, by the ids it matched, what that column holds.
            ids = [b.id for b in bindings if b.matches(schema, name, kind, data["record"])]
            if not ids:
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
