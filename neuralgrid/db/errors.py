"""Domain errors of the database layer, translated once from psycopg at this boundary."""

from __future__ import annotations


class DatabaseError(Exception):
    """Base of the platform's database errors; the message is meant for a person."""


class MigrationError(DatabaseError):
    """A migration could not be discovered or applied."""


class UnknownModel(DatabaseError):
    """No catalog entry and no node knows the requested model."""


class InvalidRequest(DatabaseError):
    """A parameter the database refused (a bad policy, a negative limit, a constraint)."""


class ConflictError(DatabaseError):
    """The state does not allow this (a job that is no longer running, say)."""
