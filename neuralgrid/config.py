"""One settings object for the whole platform, read from the environment (and `.env`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob, with its environment variable. `.env.example` documents each one."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True)

    home: Path = Field(Path("~/.neuralgrid"), alias="NEURALGRID_HOME")
    database_url: str | None = Field(None, alias="DATABASE_URL")
    db_port: int = Field(54322, alias="NEURALGRID_DB_PORT", ge=1, le=65535)
    sweep_interval_s: float = Field(1.0, alias="NEURALGRID_SWEEP_INTERVAL_S", gt=0)

    @model_validator(mode="after")
    def _expand_home(self) -> Settings:
        self.home = self.home.expanduser()
        return self

    @property
    def embedded(self) -> bool:
        """True when no DATABASE_URL is given and the platform runs its own Postgres."""
        return not self.database_url
