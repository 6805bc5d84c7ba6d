"""One settings object for the whole platform, read from the environment (and `.env`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PLACEHOLDER = "change-me"


class Settings(BaseSettings):
    """Every knob, with its environment variable. `.env.example` documents each one."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True)

    environment: Literal["development", "production"] = Field(
        "development", alias="NEURALGRID_ENV"
    )
    home: Path = Field(Path("~/.neuralgrid"), alias="NEURALGRID_HOME")
    database_url: str | None = Field(None, alias="DATABASE_URL")
    db_port: int = Field(54322, alias="NEURALGRID_DB_PORT", ge=1, le=65535)
    host: str = Field("127.0.0.1", alias="NEURALGRID_HOST")
    port: int = Field(8080, alias="NEURALGRID_PORT", ge=1, le=65535)
    jwt_secret: str = Field(PLACEHOLDER, alias="NEURALGRID_JWT_SECRET")
    heartbeat_interval_s: float = Field(5.0, alias="NEURALGRID_HEARTBEAT_INTERVAL_S", gt=0)
    sweep_interval_s: float = Field(1.0, alias="NEURALGRID_SWEEP_INTERVAL_S", gt=0)

    @model_validator(mode="after")
    def _refuse_placeholder_secrets(self) -> Settings:
        if self.environment != "development" and self.jwt_secret == PLACEHOLDER:
            raise ValueError(
                "NEURALGRID_JWT_SECRET is still the placeholder; set a real secret outside development"
            )
        self.home = self.home.expanduser()
        return self

    @property
    def embedded(self) -> bool:
        """True when no DATABASE_URL is given and the platform runs its own Postgres."""
        return not self.database_url
