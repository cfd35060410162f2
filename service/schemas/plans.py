"""Dry runs and inspections: answers computed by a worker from metadata only."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Plan(BaseModel):
    """What a job would do, computed from the source's metadata (no tensor data is read)."""

    model_config = ConfigDict(extra="allow")

    ok: bool = Field(description="false when the plan found problems (listed in errors)")
    errors: list[dict[str, Any]] = Field(default_factory=list)


class InspectView(BaseModel):
    """A checkpoint's format, sizes, dtypes and entries (the `ckptconv inspect` view)."""

    model_config = ConfigDict(extra="allow")

    uri: str
    format: str
    entries: list[dict[str, Any]]
