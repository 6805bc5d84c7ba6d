"""A hosted Supabase project, as a signed-in user: Supabase Auth through supabase-py's auth client,
and the Data API (PostgREST: the views and RPCs of supabase/migrations/*_data_api.sql) through its
postgrest client. No database password: the user's access token, and row-level security in the
project, decide what they see. docs/data-api.md describes what is read and called.

The session (the project, its publishable or anon key, supabase-py's session with the access and
refresh tokens) lives in NEURALGRID_HOME/session.json, mode 0600; an expired access token is
refreshed before a request and the new tokens written back.

Every failure is a HostedError whose text is one line for a person.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from supabase_auth import SyncSupportedStorage

from neuralgrid.verify.owners import nothing_restarted

if TYPE_CHECKING:
    from supabase import Client

SESSION_FILE = "session.json"
TIMEOUT_S = 30.0
UPTIME_DAYS = 7  # as the gateway's /api/my/earnings: uptime over the last week, whatever the period
# PostgREST answers timestamps as ISO 8601 text; the CLI's printers take datetimes, as from psycopg.
TIMESTAMPS = frozenset(
    {
        "created_at",
        "last_used_at",
        "revoked_at",
        "last_heartbeat_at",
        "cooldown_until",
        "first_day",
        "state_since",
        "last_challenge_at",
    }
)
T = TypeVar("T")


class HostedError(Exception):
    """Something a person can act on, in one line: wrong password, project unreachable, refused."""


class SessionExpired(HostedError):
    """The stored session can no longer be used: the user must sign in again."""


@dataclass(frozen=True)
class Project:
    url: str  # https://<ref>.supabase.co (or a local `supabase start`'s http://127.0.0.1:54321)
    api_key: str  # the publishable (sb_publishable_…) or legacy anon key: public, sent as `apikey`

    def __post_init__(self) -> None:
        if not self.url.startswith(("https://", "http://")):
            raise HostedError(f"the project's URL must start with https:// (not {self.url!r})")
        if not self.api_key.strip():
            raise HostedError("the project's publishable (or anon) key is empty")


def session_path(home: Path) -> Path:
    return home.expanduser() / SESSION_FILE


class SessionFile(SyncSupportedStorage):
    """supabase-py's session storage as one JSON file, with the project it belongs to. Written whole
    (to a temporary file, then renamed) and readable by its owner alone: it holds a refresh token."""

    def __init__(self, path: Path, project: Project, items: dict[str, str] | None = None) -> None:
        self.path = path
        self.project = project
        self.items = dict(items or {})

    @classmethod
    def load(cls, path: Path) -> SessionFile:
        try:
            stored = json.loads(path.read_text())
            project = Project(stored["project"], stored["api_key"])
            items = {str(k): str(v) for k, v in stored["auth"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise SessionExpired(
                f"{path} is not a session this CLI wrote ({err}): sign in again with `neuralgrid login`"
            ) from err
        return cls(path, project, items)

    def get_item(self, key: str) -> str | None:
        return self.items.get(key)

    def set_item(self, key: str, value: str) -> None:
        self.items[key] = value
        self._write()

    def remove_item(self, key: str) -> None:
        if self.items.pop(key, None) is not None:
            self._write()

    def _write(self) -> None:
        document = {"project": self.project.url, "api_key": self.project.api_key, "auth": self.items}
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        # Created 0600 from the start: never a moment when another user could read the tokens.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            json.dump(document, file, indent=2)
        os.replace(temporary, self.path)


def _client(project: Project, storage: SyncSupportedStorage) -> Client:
    from supabase import Client, ClientOptions

    options = ClientOptions(
        storage=storage,
        # A command lives seconds: refresh on use (get_session()), never from a background timer.
        auto_refresh_token=False,
        flow_type="implicit",
        # Our own HTTP client: its timeout, and no retry loop of several seconds when a project is down.
        httpx_client=httpx.Client(timeout=TIMEOUT_S, follow_redirects=True),
        postgrest_client_retry=False,
    )
    return Client(project.url, project.api_key, options)


# Translating the clients' errors, once ----------------------------------------------------------------

AUTH_MESSAGES = {
    "invalid_credentials": "wrong email or password",
    "email_not_confirmed": "this email is not confirmed yet: open the link the project sent, then sign in",
    "otp_expired": "the code has expired or is wrong: ask for a new one with `neuralgrid login --otp`",
    "otp_disabled": "the project refused to send a code (no user with this email, or codes are disabled)",
    "over_email_send_rate_limit": "the project has sent too many emails: wait a minute and try again",
    "refresh_token_not_found": "your session was signed out or has expired",
    "refresh_token_already_used": "your session was signed out or has expired",
    "session_not_found": "your session was signed out or has expired",
    "user_banned": "this user is banned from the project",
}


def _auth(project: Project, call: Callable[[], T]) -> T:
    from supabase_auth.errors import AuthApiError, AuthError, AuthRetryableError, AuthSessionMissingError

    try:
        return call()
    except AuthRetryableError as err:
        raise HostedError(f"cannot reach the project's Auth at {project.url}: {err.message}") from err
    except AuthSessionMissingError as err:
        raise SessionExpired("your session has expired: sign in again with `neuralgrid login`") from err
    except AuthApiError as err:
        said = AUTH_MESSAGES.get(str(err.code), f"{err.message} ({err.code or err.status})")
        if err.code in ("refresh_token_not_found", "refresh_token_already_used", "session_not_found"):
            raise SessionExpired(f"{said}: sign in again with `neuralgrid login`") from err
        raise HostedError(f"the project's Auth refused: {said}") from err
    except AuthError as err:
        raise HostedError(f"the project's Auth failed: {err.message}") from err


def _data_api(project: Project, call: Callable[[], T]) -> T:
    from postgrest.exceptions import APIError

    try:
        return call()
    except httpx.HTTPError as err:
        raise HostedError(f"cannot reach the project's Data API at {project.url}: {err}") from err
    except APIError as err:
        raise _refusal(err.code, err.message or "no message") from err


def _refusal(code: str | None, message: str) -> HostedError:
    """PostgREST's error (its JSON: code, message, details, hint) as what to do about it."""
    if code in ("PGRST301", "PGRST302", "PGRST303"):  # the JWT: expired, invalid, or none
        return SessionExpired(
            f"the project refused your session ({message}): sign in again with `neuralgrid login`"
        )
    if code in ("PGRST202", "PGRST205", "42883", "42P01"):  # no such function, table or view
        return HostedError(
            f"the project lacks NeuralGrid's Data API ({message}): apply supabase/migrations to it"
            " (`supabase db push`, or `neuralgrid db migrate`)"
        )
    if code == "42501":
        return HostedError(f"the project refused ({message}): this is not yours to read or change")
    return HostedError(f"the project refused ({code}): {message}")


# Signing in and out ----------------------------------------------------------------------------------------


def sign_in_with_password(home: Path, project: Project, email: str, password: str) -> str:
    """Signs in and stores the session; returns the user's email as Auth has it."""
    storage = SessionFile(session_path(home), project)  # written only once Auth has said yes
    client = _client(storage.project, storage)
    response = _auth(
        project, lambda: client.auth.sign_in_with_password({"email": email, "password": password})
    )
    return (response.user.email if response.user else None) or email


def send_code(project: Project, email: str) -> None:
    """Asks the project to email a one-time code; an address with no user is never signed up here."""
    from supabase_auth import SyncMemoryStorage

    client = _client(project, SyncMemoryStorage())  # nothing to keep until the code is verified
    _auth(
        project,
        lambda: client.auth.sign_in_with_otp({"email": email, "options": {"should_create_user": False}}),
    )


def sign_in_with_code(home: Path, project: Project, email: str, code: str) -> str:
    """Signs in with the emailed code and stores the session; returns the user's email."""
    storage = SessionFile(session_path(home), project)
    client = _client(storage.project, storage)
    response = _auth(
        project, lambda: client.auth.verify_otp({"email": email, "token": code.strip(), "type": "email"})
    )
    return (response.user.email if response.user else None) or email


def sign_out(home: Path) -> tuple[str, str | None] | None:
    """Forgets the stored session, and ends it on the project (this device's session only): the
    project's URL and, when the project could not be told, why. None when no one was signed in."""
    path = session_path(home)
    if not path.exists():
        return None
    try:
        storage = SessionFile.load(path)
    except SessionExpired:
        path.unlink()
        return str(path), None
    client = _client(storage.project, storage)
    try:
        _auth(storage.project, lambda: client.auth.sign_out({"scope": "local"}))
        untold = None
    except HostedError as err:
        untold = str(err)
    finally:
        path.unlink(missing_ok=True)  # whatever the project said: signed out here
    return storage.project.url, untold


# The Data API, as the signed-in user --------------------------------------------------------------------


@dataclass
class DataApi:
    """What the CLI reads and calls through a signed-in project; rows come back as the database
    path's do (datetimes, floats), so one printer serves both."""

    client: Client
    project: Project
    email: str

    def _rows(self, call: Callable[[], Any]) -> list[dict[str, Any]]:
        data = _data_api(self.project, lambda: call().data)
        return [_typed(row) for row in data]

    def api_keys(self) -> list[dict[str, Any]]:
        return self._rows(lambda: self.client.table("my_api_keys").select("*").order("created_at").execute())

    def create_api_key(
        self, name: str, rpm: int | None, tpm: int | None, budget_usd: float | None
    ) -> dict[str, Any]:
        params = {"p_name": name, "p_rpm_limit": rpm, "p_tpm_limit": tpm, "p_budget_usd": budget_usd}
        (created,) = self._rows(lambda: self.client.rpc("create_api_key", params).execute())
        return created

    def revoke_api_key(self, id_or_prefix: str) -> str:
        """Revoke one active key of the user's, by id or shown prefix (as the service path does)."""
        found = [k for k in self.api_keys() if k["active"] and id_or_prefix in (k["id"], k["prefix"])]
        if not found:
            raise HostedError(f"no active key of yours with id or prefix {id_or_prefix!r}")
        if len(found) > 1:
            raise HostedError(f"{id_or_prefix!r} matches {len(found)} keys: use the id")
        key = found[0]
        _data_api(self.project, lambda: self.client.rpc("revoke_api_key", {"p_key_id": key["id"]}).execute())
        return f"{key['prefix']}… ({key['id']})"

    def nodes(self) -> list[dict[str, Any]]:
        return self._rows(lambda: self.client.rpc("my_nodes", {}).execute())

    def usage(self, days: int) -> list[dict[str, Any]]:
        since = first_day(days).isoformat()
        return self._rows(
            lambda: (
                self.client.table("my_usage")
                .select("*")
                .gte("day", since)
                .order("day")
                .order("key_name")
                .order("model_id")
                .execute()
            )
        )

    def earnings(self, days: int) -> dict[str, Any]:
        """What the gateway's /api/my/earnings answers, read through the owner's RPCs."""
        start = first_day(days)
        since = {"p_since": datetime.combine(start, datetime.min.time(), UTC).isoformat()}
        by_day = self._rows(lambda: self.client.rpc("my_earnings", since).execute())
        (totals,) = self._rows(lambda: self.client.rpc("my_earnings_totals", since).execute())
        nodes = self._rows(
            lambda: self.client.rpc("my_node_stats", {"p_window": f"{UPTIME_DAYS} days"}).execute()
        )
        (settings,) = self._rows(
            lambda: self.client.table("platform_settings").select("platform_fee_rate").execute()
        )
        checks = self._rows(lambda: self.client.rpc("my_model_checks", {}).execute())
        return {
            "days": days,
            "first_day": start,
            "fee_rate": float(settings["platform_fee_rate"]),
            "totals": totals,
            "by_day": by_day,
            "nodes": nodes,
            "checks": checks,
        }

    def request_verification(self, name_or_id: str) -> dict[str, Any]:
        """What the gateway's POST /api/my/verification answers: the node's failed models, each
        starting over; refused, as the gateway refuses, when none had failed."""
        nodes = self.nodes()
        node = next((n for n in nodes if n["id"] == name_or_id), None) or next(
            (n for n in nodes if n["name"] == name_or_id), None
        )
        if node is None:
            raise HostedError(f"you have no node named {name_or_id!r} (nor with that id)")
        started = self._rows(
            lambda: self.client.rpc("request_verification", {"p_node_id": node["id"]}).execute()
        )
        if not started:
            checks = self._rows(lambda: self.client.rpc("my_model_checks", {}).execute())
            states = [(c["model_id"], c["state"]) for c in checks if c["node_id"] == node["id"]]
            raise HostedError(nothing_restarted(node["name"], states))
        return {"node_id": node["id"], "node_name": node["name"], "models": started}


def first_day(days: int) -> date:
    """The first UTC day of a period of `days` days ending today."""
    return datetime.now(UTC).date() - timedelta(days=days - 1)


def _typed(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: datetime.fromisoformat(v) if k in TIMESTAMPS and isinstance(v, str) else v for k, v in row.items()
    }


def signed_in(home: Path) -> DataApi | None:
    """The Data API as the user of the stored session (refreshed first when it has expired), or None
    when no one has signed in from this home."""
    path = session_path(home)
    if not path.exists():
        return None
    storage = SessionFile.load(path)
    client = _client(storage.project, storage)
    session = _auth(storage.project, client.auth.get_session)
    if session is None:  # supabase-py drops a stored session it cannot read
        raise SessionExpired("your session has expired: sign in again with `neuralgrid login`")
    client.postgrest.auth(session.access_token)
    return DataApi(client, storage.project, session.user.email or session.user.id)
