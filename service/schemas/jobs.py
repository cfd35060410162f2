"""The job resource: what ``POST /v1/jobs`` accepts and what ``GET /v1/jobs/{id}`` returns.

The request is a union discriminated by ``kind``, built from the registry of job kinds
(:mod:`ckptconv.jobs.kinds`): each kind brings its options model and says whether it needs a target.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from ckptconv.core.job_records import STATES
from ckptconv.core.webhooks import DELIVERY_ERRORS
from ckptconv.jobs.kinds import KINDS, JobKind
from service.schemas.common import Problem, SourceRef, StrictModel, TargetRef

MAX_LABELS = 32
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
LabelKey = Annotated[str, Field(pattern=LABEL_KEY.pattern)]
LabelValue = Annotated[str, Field(max_length=256, pattern=r"^[^\x00-\x1f]*$")]
JobState = Literal[STATES]  # type: ignore[valid-type]
KindName = Literal[tuple(KINDS)]  # type: ignore[valid-type]


class WebhookIn(StrictModel):
    url: str = Field(
        max_length=2048, pattern=r"^https?://[^\s/]+", description="called once when the job ends (POST, JSON)"
    )
    secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="signing secret (whsec_ + base64, Standard Webhooks); the service's own secret when omitted",
    )


class _JobRequestBase(StrictModel):
    source: SourceRef
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, description=f"at most {MAX_LABELS}")
    webhook: WebhookIn | None = None
    max_runtime_seconds: int | None = Field(
        default=None, ge=1, le=30 * 86400, description="the job fails with time_limit_exceeded after this long"
    )

    @field_validator("labels")
    @classmethod
    def _few_labels(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_LABELS:
            raise ValueError(f"at most {MAX_LABELS} labels")
        return value


class _PlanRequestBase(StrictModel):
    source: SourceRef


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[-_]", name))


def _request_model(kind: JobKind, base: type[BaseModel], suffix: str) -> type[BaseModel]:
    fields: dict[str, Any] = {
        "kind": (Literal[kind.name], Field(description=kind.description)),  # type: ignore[valid-type]
        "options": (kind.options, Field(default_factory=kind.options)),
    }
    if kind.target == "required":
        fields["target"] = (TargetRef, ...)
    elif kind.target == "optional":
        fields["target"] = (TargetRef | None, None)
    return create_model(f"{_camel(kind.name)}{suffix}", __base__=base, **fields)


def _union(models: list[type[BaseModel]]) -> Any:
    if len(models) == 1:
        return models[0]
    return Annotated[Union[tuple(models)], Field(discriminator="kind")]  # noqa: UP007


JobRequest = _union([_request_model(k, _JobRequestBase, "JobRequest") for k in KINDS.values()])
PlanRequest = _union([_request_model(k, _PlanRequestBase, "PlanRequest") for k in KINDS.values()])


class Progress(BaseModel):
    model_config = ConfigDict(extra="allow")

    stage: str = Field(description="planning | converting | verifying | publishing | done")
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int
    fraction: float | None = Field(default=None, description="bytes_done / bytes_total of the current stage")
    throughput_bytes_per_s: float | None = None
    eta_seconds: float | None = None


class OutputFile(BaseModel):
    model_config = ConfigDict(extra="allow")

    uri: str
    size: int
    role: str | None = None
    blake3: str | None = Field(
        default=None,
        description="BLAKE3 (hex) of the file; null for a file written out of order (see blake3_blocks) unless"
        " the job ran with verify: full",
    )
    blake3_blocks: dict[str, Any] | None = Field(
        default=None,
        description="block digest of a file written out of order: {block_size, blake3}, the BLAKE3 of the"
        " lines '<BLAKE3 of each block_size-byte block>\\n'; with coreutils and b3sum:"
        " split -b BLOCK_SIZE --filter=b3sum FILE | cut -c1-64 | b3sum",
    )
    sha256: str | None = Field(
        default=None,
        description="results recorded by versions before BLAKE3 digests: sha256 of the file, in place of blake3",
    )
    sha256_blocks: dict[str, Any] | None = Field(
        default=None,
        description="results recorded by versions before BLAKE3 digests: the block digest in sha256"
        " ({block_size, sha256}; split -b BLOCK_SIZE --filter=sha256sum FILE | cut -c1-64 | sha256sum)",
    )


class JobResult(BaseModel):
    """What a finished job produced; kinds may add fields."""

    model_config = ConfigDict(extra="allow")

    outputs: list[OutputFile] = Field(default_factory=list)
    manifest: str | None = None
    warnings: list[str] = Field(default_factory=list)


class WebhookOut(BaseModel):
    url: str
    attempts: int = Field(description="delivery attempts so far")
    last_status: int | None = Field(description="HTTP status of the last attempt")
    last_error: Literal[DELIVERY_ERRORS] | None = Field(  # type: ignore[valid-type]
        description="why the last attempt failed: http_status (see last_status), refused (the destination "
        "is not allowed), unresolvable, timeout, connect_error or transport_error; null once delivered"
    )
    delivered_at: datetime | None


class JobLinks(BaseModel):
    self: str
    events: str
    cancel: str


class Job(BaseModel):
    id: str
    kind: str
    state: JobState
    done: bool = Field(description="true once the state is succeeded, failed or cancelled")
    source: SourceRef
    target: TargetRef | None
    options: dict[str, Any]
    labels: dict[str, str]
    webhook: WebhookOut | None
    max_runtime_seconds: int
    progress: Progress | None
    result: JobResult | None
    error: Problem | None
    attempts: int = Field(description="how many times a worker started the job (more than 1 after a worker was lost)")
    created_at: datetime
    started_at: datetime | None
    updated_at: datetime
    finished_at: datetime | None
    links: JobLinks


class JobList(BaseModel):
    jobs: list[Job]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null on the last page")


def _event(name: str, description: str, data_schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "required": ["event", "data"],
        "properties": {
            "event": {"const": name},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data_schema},
            "id": {"type": "string", "pattern": r"^\d+-\d+$", "description": "stream position (Last-Event-ID)"},
        },
    }


# One server-sent event of GET /v1/jobs/{id}/events (OpenAPI before 3.2: the schema of a
# text/event-stream response describes each event, as its `event`, `data` and `id` fields).
JOB_EVENT = {
    "oneOf": [
        _event("job", "the job resource: first, and last when the job ends", {"$ref": "#/components/schemas/Job"}),
        _event("progress", "progress of the running job", {"$ref": "#/components/schemas/Progress"}),
        _event(
            "state",
            "a state change",
            {
                "type": "object",
                "required": ["state", "previous", "at"],
                "properties": {
                    "state": {"enum": list(STATES)},
                    "previous": {"enum": list(STATES)},
                    "at": {"type": "integer", "description": "Unix time in milliseconds"},
                },
            },
        ),
    ]
}
