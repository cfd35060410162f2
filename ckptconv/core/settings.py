"""One settings object for the API and the worker, read from ``CKPTCONV_*`` environment variables.

Outside ``environment=development`` it refuses what is only safe on a laptop: disabled
authentication and the default webhook signing secret. ``REDIS_URL`` is honoured as well as
``CKPTCONV_REDIS_URL``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_WEBHOOK_SECRET = "whsec_ZGV2ZWxvcG1lbnQtb25seS1kby1ub3QtdXNlLWluLXByb2R1Y3Rpb24="


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTCONV_", extra="ignore")

    environment: Literal["development", "production"] = "production"

    # Redis holds job records, API keys, idempotency records and the Celery queues.
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("CKPTCONV_REDIS_URL", "REDIS_URL"),
    )
    # Every Redis key ckptconv (and its Celery transport) uses starts with this; two deployments
    # (or two test runs) sharing one Redis stay apart by using different prefixes.
    redis_prefix: str = Field(default="ckptconv:", min_length=1, max_length=64)
    jobs_queue: str = "jobs"
    interactive_queue: str = "interactive"  # dry runs, inspections, webhooks: short tasks

    # Authentication: API keys are stored hashed in Redis (`ckptconv keys create`) or in this file.
    auth_disabled: bool = False
    api_keys_file: Path | None = None
    auth_cache_seconds: float = Field(default=30.0, ge=0)

    # Edges of the API. Bodies larger than this are refused (413) while they are read.
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    # A body not received whole this long after the request's head is refused (408, connection
    # closed): a client that stops sending would otherwise hold its connection forever.
    body_read_timeout_seconds: float = Field(default=30.0, gt=0)
    # The same for a request's head, counted from the connection's opening or the previous response
    # (ckptconv.cli.http_protocol): the connection is closed.
    head_read_timeout_seconds: float = Field(default=30.0, gt=0)
    # Requests per API key per second, counted in Redis across every API process (429 beyond; 0: off).
    rate_limit_per_second: int = Field(default=100, ge=0)
    # Event streams (GET /v1/jobs/{id}/events) one API key may hold open at once, across processes.
    max_streams_per_key: int = Field(default=16, ge=1)
    # Redis connections of one API process: short commands, and what blocks (event streams, dry-run
    # waits). A request that finds its pool exhausted waits ``redis_pool_timeout_seconds``, then 503.
    redis_max_connections: int = Field(default=64, ge=2)
    redis_blocking_connections: int = Field(default=128, ge=1)
    redis_pool_timeout_seconds: float = Field(default=5.0, gt=0)

    # Jobs.
    default_max_runtime_seconds: int = Field(default=6 * 3600, gt=0)
    max_runtime_limit_seconds: int = Field(default=7 * 86400, gt=0)
    job_retention_seconds: int = Field(default=30 * 86400, ge=0)  # 0 keeps records forever
    idempotency_ttl_seconds: int = Field(default=86400, gt=0)
    # The broker re-delivers a task whose message was not acknowledged (or, here, whose lease was
    # not renewed) for this long; workers renew every ``heartbeat_seconds``. See worker/tasks.py.
    visibility_timeout_seconds: float = Field(default=300.0, gt=0)
    heartbeat_seconds: float = Field(default=10.0, gt=0)
    # A job whose worker died this many times fails (worker_lost) instead of being run again.
    max_attempts: int = Field(default=3, ge=1)
    # A job with ``parallelism: "auto"`` is cut into one part per this many output bytes, at most
    # ``auto_parallelism_max`` parts (see ckptconv.engine.fanout.auto).
    auto_parallelism_part_bytes: int = Field(default=2 << 30, ge=1 << 20)
    auto_parallelism_max: int = Field(default=16, ge=1, le=256)
    # Every worker looks for jobs with neither a live owner nor a message this often (worker/reaper.py).
    reaper_interval_seconds: float = Field(default=30.0, gt=0)

    # The API's own look at a job's target at submit (is something there already?): bounded, so
    # that a slow object store answers 503 instead of holding the request.
    target_check_timeout_seconds: float = Field(default=5.0, gt=0)
    # Synchronous worker round trips of the API (dry runs, inspections).
    plan_timeout_seconds: float = Field(default=60.0, gt=0)

    # Completion webhooks (Standard Webhooks signatures).
    webhook_secret: SecretStr = SecretStr(DEFAULT_WEBHOOK_SECRET)
    webhook_max_attempts: int = Field(default=8, ge=1)
    webhook_backoff_seconds: float = Field(default=2.0, gt=0)
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    webhook_allow_private_networks: bool = False

    # GET /readyz lists one object under this URI to prove the object store answers.
    storage_probe_uri: str | None = None

    # Process tuning for the API (see measurements: full collections dominate p99 latency).
    gc_freeze: bool = True

    @model_validator(mode="after")
    def _refuse_unsafe_defaults(self) -> Settings:
        if self.environment != "development":
            if self.auth_disabled:
                raise ValueError("auth_disabled is only allowed with CKPTCONV_ENVIRONMENT=development")
            if self.webhook_secret.get_secret_value() == DEFAULT_WEBHOOK_SECRET:
                raise ValueError(
                    "set CKPTCONV_WEBHOOK_SECRET (e.g. whsec_ + base64 of 32 random bytes): the default secret "
                    "is only allowed with CKPTCONV_ENVIRONMENT=development"
                )
        if self.heartbeat_seconds * 3 > self.visibility_timeout_seconds:
            raise ValueError("visibility_timeout_seconds must be at least 3 heartbeats (heartbeat_seconds * 3)")
        return self

    @property
    def lease_seconds(self) -> float:
        """How long a worker's claim on a job lasts without a heartbeat."""
        return self.heartbeat_seconds * 3

    @property
    def broker_prefix(self) -> str:
        """Key prefix of the Celery transport (kombu's ``global_keyprefix``)."""
        return self.redis_prefix + "q:"


@lru_cache
def get_settings() -> Settings:
    return Settings()
