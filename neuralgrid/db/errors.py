"""Domain errors of the database layer, translated once from psycopg at this boundary."""

from __future__ import annotations


class DatabaseError(Exception):
    """Base of the platform's database errors; the message is meant for a person, `param` names the
    request parameter at fault where the query knows it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class MigrationError(DatabaseError):
    """A migration could not be discovered or applied."""


class NotFound(DatabaseError):
    """What the statement is about does not exist (a model nobody serves, a node)."""


class Forbidden(DatabaseError):
    """The caller may not do this (a node secret that is not this node's)."""


class InvalidRequest(DatabaseError):
    """A parameter the database refused (a bad policy, a negative limit, a constraint)."""


class BudgetExhausted(DatabaseError):
    """The API key's USD budget is spent (or fully held by requests in flight)."""


class ConflictError(DatabaseError):
    """The state does not allow this (a job that is no longer running, say)."""


# SQLSTATEs our SQL functions and constraints raise, and the domain error each one means.
_BY_SQLSTATE: dict[str, type[DatabaseError]] = {
    "P0002": NotFound,  # no_data_found
    "42501": Forbidden,  # insufficient_privilege
    "22023": InvalidRequest,  # invalid_parameter_value
    "22P02": InvalidRequest,  # invalid_text_representation
    "22P05": InvalidRequest,  # untranslatable_character (\u0000 in jsonb)
    "22003": InvalidRequest,  # numeric_value_out_of_range
    "23502": InvalidRequest,  # not_null_violation
    "23514": InvalidRequest,  # check_violation
    "23503": InvalidRequest,  # foreign_key_violation
    "23505": ConflictError,  # unique_violation
    "55000": ConflictError,  # object_not_in_prerequisite_state
    "NG402": BudgetExhausted,  # raised by match_job()
}


def translate(err: Exception, subject: str | None = None) -> Exception:
    """The domain error for a psycopg error we know, or the error itself. A NotFound is about
    `subject`, the parameter the statement looks up; an InvalidRequest about the column its error
    names (`raise ... using column = 'budget_usd'`), if it names one."""
    diag = getattr(err, "diag", None)
    message = getattr(diag, "message_primary", None) or str(err)
    rule = getattr(diag, "constraint_name", None) or ""
    if getattr(err, "sqlstate", None) == "23514" and " " in rule:  # our row rules are named as sentences
        message = rule
    found = from_sqlstate(getattr(err, "sqlstate", None), message, subject)
    if isinstance(found, InvalidRequest):
        found.param = getattr(diag, "column_name", None)
    return found or err


def from_sqlstate(sqlstate: str | None, message: str, subject: str | None = None) -> DatabaseError | None:
    """The domain error a SQLSTATE means (None for one we do not know), as translate() gives it; for
    errors a function caught and reported in its rows (place_jobs())."""
    kind = _BY_SQLSTATE.get(sqlstate or "")
    return None if kind is None else kind(message, subject if kind is NotFound else None)
