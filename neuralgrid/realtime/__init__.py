"""A Supabase-Realtime-compatible server for the embedded stack.

Speaks the Realtime protocol (vsn 1.0.0 JSON objects and 2.0.0 JSON arrays) at /realtime/v1/websocket:
postgres_changes (RLS- and grant-filtered per subscriber), broadcast (from clients and from the
database's realtime.messages), presence, heartbeats and access-token refresh. Postgres feeds it with
NOTIFY (see neuralgrid/db/sql/realtime_feed.sql), so every gateway instance delivers every change.
On a Supabase project, Supabase's own Realtime does this job and this package is not used.
"""
