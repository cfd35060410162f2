"""What the service knows: container formats and job kinds."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Format(BaseModel):
    name: str
    description: str
    read: bool
    write: bool
    suffixes: list[str]


class FormatList(BaseModel):
    formats: list[Format]


class Kind(BaseModel):
    name: str
    description: str
    target: str
    options_schema: dict[str, Any]


class KindList(BaseModel):
    kinds: list[Kind]
