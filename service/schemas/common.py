"""Schemas shared by several resources: storage references and the problem document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ckptconv.formats import FORMATS

FormatName = Literal[tuple(FORMATS)]  # type: ignore[valid-type]
WritableFormat = Literal[tuple(name for name, spec in FORMATS.items() if spec.sink)]  # type: ignore[valid-type]

Uri = Annotated[
    str,
    Field(
        min_length=1,
        max_length=2048,
        description="s3://bucket/key or an absolute path on the workers' filesystem",
        examples=["s3://models/llama/model.safetensors"],
    ),
]


class StrictModel(BaseModel):
    """Request bodies: unknown fields and type coercions are refused (a typo never passes silently)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class SourceRef(StrictModel):
    uri: Uri
    format: FormatName | None = Field(default=None, description="detected from the URI and contents when omitted")


class TargetRef(StrictModel):
    uri: Uri
    format: WritableFormat


class Problem(BaseModel):
    """An RFC 9457 problem document; ``code`` is stable and machine-readable."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    code: str
    detail: str
    hint: str | None = None
    instance: str | None = None
    details: dict[str, Any] | None = None
    correlation_id: str | None = Field(
        default=None, description="server errors (5xx): the id the service logged the details under"
    )


PROBLEM_JSON = "application/problem+json"


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries declaring that these statuses answer with a problem document."""
    text = {
        400: "Bad request",
        401: "Missing, unknown or revoked API key",
        403: "The API key may not access a URI of the request",
        404: "No such resource (or it belongs to another API key)",
        405: "Method not allowed",
        408: "Time limit exceeded, or the request body was not received in time",
        409: "Conflict with the resource's current state, or a request with this Idempotency-Key is in flight",
        413: "Request body too large",
        422: "Invalid request (validation errors, or an Idempotency-Key reused with a different body)",
        429: "Too many requests for this API key (see Retry-After)",
        500: "Internal error",
        502: "The object store failed",
        503: "Redis, the object store or the workers did not answer",
    }
    # The content (application/problem+json with the Problem schema) is filled in for every error
    # status when the OpenAPI document is built (service.app.build_openapi).
    return {code: {"description": text.get(code, "Error")} for code in codes}
