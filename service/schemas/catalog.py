"""What the service knows: container formats and job kinds."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Format(BaseModel):
    """One entry of the format registry (``ckptconv.formats.registry``)."""

    name: str
    description: str
    read: bool
    write: bool
    suffixes: list[str] = Field(description="file-name endings that identify the format, index files included")
    sharded: bool = Field(description="one checkpoint may be several files")
    links: bool = Field(description="tied weights stay one value; otherwise each link is written as a copy")
    objects: bool = Field(description="opaque objects (bytes a source would not decode) are kept")
    cannot_hold: list[str] = Field(description="tensor dtypes a conversion to this format refuses")


class FormatList(BaseModel):
    formats: list[Format]


class Kind(BaseModel):
    name: str
    description: str
    target: str
    options_schema: dict[str, Any]


class KindList(BaseModel):
    kinds: list[Kind]
