"""Settings: environment variables, and the secrets refused outside development."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from neuralgrid.server.settings import PLACEHOLDER_SECRET, Settings


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURALGRID_PORT", "9999")
    monkeypatch.setenv("NEURALGRID_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("DATABASE_URL", "postgresql://db.example/postgres")
    settings = Settings()
    assert (settings.port, settings.max_attempts, settings.embedded) == (9999, 5, False)


def test_production_refuses_placeholder_and_short_secrets() -> None:
    with pytest.raises(ValidationError, match="placeholder"):
        Settings(NEURALGRID_ENV="production", NEURALGRID_JWT_SECRET=PLACEHOLDER_SECRET)
    with pytest.raises(ValidationError, match="at least 32"):
        Settings(NEURALGRID_ENV="production", NEURALGRID_JWT_SECRET="short")
    assert Settings(NEURALGRID_ENV="production", NEURALGRID_JWT_SECRET="x" * 40).environment == "production"


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValidationError):
        Settings(NEURALGRID_PORT=0)
    with pytest.raises(ValidationError):
        Settings(NEURALGRID_MAX_ATTEMPTS=0)
