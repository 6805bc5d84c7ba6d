"""Settings: environment variables, and the secrets refused outside development."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_generic_environment_variables_are_not_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only NEURALGRID_* names (and DATABASE_URL, REDIS_URL) are read: a shell's HOME, HOST, PORT or
    ENVIRONMENT must not move the state directory, the gateway or break start-up."""
    for name in ("NEURALGRID_HOME", "NEURALGRID_HOST", "NEURALGRID_PORT", "NEURALGRID_ENV"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {
        "HOME": "/tmp/somebody-else",
        "HOST": "0.0.0.0",
        "PORT": "1",
        "ENVIRONMENT": "staging",
        "JWT_SECRET": "x" * 40,
        "MAX_ATTEMPTS": "9",
    }.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert str(settings.home) == "/tmp/somebody-else/.neuralgrid"  # ~/.neuralgrid, not ~ itself
    assert (settings.host, settings.port, settings.environment) == ("127.0.0.1", 8080, "development")
    assert (settings.jwt_secret, settings.max_attempts) == (PLACEHOLDER_SECRET, 3)


def test_every_setting_is_in_the_example_file_and_the_configuration_page() -> None:
    """README and docs/configuration.md say `.env.example` lists every variable; seven had been
    missing from it (a new user's trial), two from the page."""
    root = Path(__file__).resolve().parents[2]
    example = (root / ".env.example").read_text()
    page = (root / "docs" / "configuration.md").read_text()
    names = {str(field.alias) for field in Settings.model_fields.values()}
    assert {name for name in names if not re.search(rf"^#? ?{name}=", example, re.MULTILINE)} == set()
    assert {name for name in names if f"`{name}`" not in page and f"`{name}`," not in page} == set()
