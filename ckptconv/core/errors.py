"""Every error a user can cause, with a stable code and a message that says what to do.

One hierarchy serves the engine, the CLI and the HTTP API:

- each class carries a stable machine-readable ``code``, an ``http_status`` and a short ``title``;
- the message is the human sentence, ``hint`` says what to do about it;
- ``to_problem()`` renders an RFC 9457 ``application/problem+json`` body;
- instances pickle (Celery sends them between processes) and rebuild from a problem body
  (``from_problem``), so a worker's error reaches the API unchanged;
- where a built-in exception means the same thing, a class also derives from it, so code that
  knows only Python's exceptions handles ours: a missing object is a ``FileNotFoundError``, a
  storage failure an ``OSError``, an existing target a ``FileExistsError``, a bad request or an
  unreadable checkpoint a ``ValueError``, an unknown resource a ``LookupError``, a deadline a
  ``TimeoutError``. ``CkptconvError`` comes first in each class's bases, so its ``__init__``,
  ``__str__`` and pickling win over the built-in's. Code that translates third-party ``OSError`` or
  ``ValueError`` into ours lets ``CkptconvError`` pass through first (it is one of those now).

This module imports nothing heavy: the API process uses it too.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, ClassVar


class CkptconvError(Exception):
    """Root of every error ckptconv raises on purpose."""

    code: ClassVar[str] = "internal_error"
    http_status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal error"
    default_hint: ClassVar[str | None] = None

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self).__name__, self.message, self.hint, self.details))

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """The RFC 9457 problem document for this error."""
        body: dict[str, Any] = {
            "type": f"https://ckptconv.dev/problems/{self.code}",
            "title": self.title,
            "status": self.http_status,
            "code": self.code,
            "detail": self.message,
        }
        if self.hint:
            body["hint"] = self.hint
        if instance:
            body["instance"] = instance
        details = dict(self.details)
        correlation_id = details.pop("correlation_id", None)
        if details:
            body["details"] = _jsonable(details)
        if correlation_id:
            body["correlation_id"] = str(correlation_id)
        return body

    @classmethod
    def from_problem(cls, body: dict[str, Any]) -> CkptconvError:
        """Rebuild an error from a problem document (e.g. one stored on a failed job)."""
        klass = _BY_CODE.get(str(body.get("code")), CkptconvError)
        details = dict(body.get("details") or {})
        if body.get("correlation_id"):
            details["correlation_id"] = body["correlation_id"]
        return klass(str(body.get("detail", "")), hint=body.get("hint"), **details)

    def public(self, log: logging.Logger, where: str) -> CkptconvError:
        """What a client may see of this error: client errors (4xx) describe the request and are shown
        as they are; a server error (5xx) is shown by :meth:`logged` (once: a worker's logged error
        keeps its correlation id on its way through the API)."""
        if self.http_status < 500 or "correlation_id" in self.details:
            return self
        return self.logged(log, where, self.__cause__ or (self if self.__traceback__ is not None else None))

    def logged(self, log: logging.Logger, where: str, cause: BaseException | None = None) -> CkptconvError:
        """This error as a client may see it, for failures on the service's side (5xx).

        Logs everything (message, details, the cause's traceback) under a new correlation id and
        returns an error of the same class that says only its title and that id: exception text,
        endpoint URLs and other internals stay in the log.
        """
        correlation_id = "corr_" + uuid.uuid4().hex[:20]
        log.error(
            "%s %s [correlation id %s]: %s%s",
            self.code,
            where,
            correlation_id,
            self.message,
            f" {self.details}" if self.details else "",
            exc_info=cause,
        )
        message = f"{self.title}; the service logged the details under correlation id {correlation_id}"
        return type(self)(message, correlation_id=correlation_id)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _rebuild(name: str, message: str, hint: str | None, details: dict[str, Any]) -> CkptconvError:
    klass = _BY_NAME.get(name, CkptconvError)
    return klass(message, hint=hint, **details)


# --- request and API errors -------------------------------------------------------------------


class InvalidRequest(CkptconvError, ValueError):
    code = "invalid_request"
    http_status = 422
    title = "Invalid request"


class UnknownFormat(InvalidRequest):
    code = "unknown_format"
    title = "Unknown format"
    default_hint = "run `ckptconv formats` (or GET /v1/formats) for the names ckptconv accepts"


class UnknownModel(InvalidRequest):
    code = "unknown_model"
    title = "Unknown model"
    default_hint = "run `ckptconv models` (or GET /v1/models) for the model names ckptconv accepts"


class Unauthorized(CkptconvError):
    code = "unauthorized"
    http_status = 401
    title = "Unauthorized"
    default_hint = "send an API key as `Authorization: Bearer <key>`"


class Forbidden(CkptconvError):
    code = "forbidden"
    http_status = 403
    title = "Forbidden"


class NotFound(CkptconvError, LookupError):
    code = "not_found"
    http_status = 404
    title = "Not found"


class Conflict(CkptconvError):
    code = "conflict"
    http_status = 409
    title = "Conflict"


class IdempotencyMismatch(InvalidRequest):
    code = "idempotency_key_reused"
    title = "Idempotency key reused with a different request"
    default_hint = "use a new Idempotency-Key for a different request body"


class ServiceUnavailable(CkptconvError):
    code = "service_unavailable"
    http_status = 503
    title = "Service unavailable"
    default_hint = "retry later; check that Redis and the object store are reachable"


class UnknownJobKind(InvalidRequest):
    code = "unknown_job_kind"
    title = "Unknown job kind"
    default_hint = "GET /v1/kinds lists the job kinds this service runs"


class MethodNotAllowed(CkptconvError):
    code = "method_not_allowed"
    http_status = 405
    title = "Method not allowed"


class IdempotentRequestInFlight(Conflict):
    code = "idempotent_request_in_flight"
    title = "A request with this Idempotency-Key is still being processed"
    default_hint = "wait for the first request to finish, then retry to get its response"


class PayloadTooLarge(CkptconvError):
    code = "payload_too_large"
    http_status = 413
    title = "Request body too large"


class BodyTimeout(CkptconvError):
    """The request's body did not arrive within ``body_read_timeout_seconds`` of its head."""

    code = "body_timeout"
    http_status = 408
    title = "Request body not received in time"
    default_hint = "send the whole body at once, as soon as the request's headers"


class RateLimited(CkptconvError):
    """Too many requests for this API key; ``retry_after`` (seconds) becomes the Retry-After header."""

    code = "rate_limited"
    http_status = 429
    title = "Too many requests"
    default_hint = "retry after the number of seconds in the Retry-After header"

    def __init__(self, message: str, *, hint: str | None = None, retry_after: int = 1, **details: Any) -> None:
        super().__init__(message, hint=hint, retry_after=retry_after, **details)
        self.retry_after = max(1, int(retry_after))


class TooManyStreams(RateLimited):
    code = "too_many_streams"
    title = "Too many open event streams"
    default_hint = "close an event stream of this API key (or poll GET /v1/jobs/{id}) and retry"


class WebhookRefused(InvalidRequest):
    code = "webhook_refused"
    title = "Webhook destination refused"
    default_hint = "use a public http(s) URL: private, loopback, link-local and reserved addresses are refused"


class WorkerTimeout(ServiceUnavailable, TimeoutError):
    code = "worker_timeout"
    title = "No worker answered in time"
    default_hint = "retry later; check that a worker consumes the interactive queue (`ckptconv worker`)"


class StorageUnavailable(ServiceUnavailable, OSError):
    """The object store did not answer a check the API makes itself (in time, or at all)."""

    code = "storage_unavailable"
    title = "Object store unavailable"
    default_hint = "retry after the Retry-After delay; check that the object store is reachable"
    retry_after = 5


# --- storage ---------------------------------------------------------------------------------


class StorageError(CkptconvError, OSError):
    code = "storage_error"
    http_status = 502
    title = "Storage error"
    default_hint = "check the URI, the credentials (AWS_* variables) and that the object store is reachable"


class ObjectNotFound(StorageError, FileNotFoundError):
    code = "object_not_found"
    http_status = 404
    title = "Object not found"
    default_hint = "check the URI: nothing exists there"


class TargetExists(CkptconvError, FileExistsError):
    code = "target_exists"
    http_status = 409
    title = "Target already exists"
    default_hint = "choose another target URI or delete the existing one first; ckptconv never overwrites"


class TargetTaken(Conflict):
    code = "target_taken"
    title = "Another job is writing this target"
    default_hint = "wait for that job to end, cancel it, or choose another target URI"


class PathEscape(CkptconvError, ValueError):
    code = "path_escape"
    http_status = 422
    title = "Key or path escapes its prefix"
    default_hint = "keys and shard names must stay below their checkpoint's prefix (no '..', no absolute paths)"


# --- checkpoint input ------------------------------------------------------------------------


class CheckpointError(CkptconvError, ValueError):
    """The checkpoint itself is unreadable or unacceptable."""

    code = "bad_checkpoint"
    http_status = 422
    title = "Bad checkpoint"


class UnsupportedFormat(CheckpointError):
    code = "unsupported_format"
    title = "Unsupported or unrecognised checkpoint format"
    default_hint = "name the format explicitly (e.g. --from safetensors) or check that the URI is a checkpoint"


class CorruptCheckpoint(CheckpointError):
    code = "corrupt_checkpoint"
    title = "Corrupt or truncated checkpoint"
    default_hint = "the file is damaged or truncated; copy it again from its origin"


class LinkCycle(CorruptCheckpoint):
    """Tied-weight links that lead back to themselves: no entry along the chain holds a value."""

    code = "link_cycle"
    title = "Tied-weight links form a cycle"
    default_hint = "the checkpoint's links (tied weights) lead back to themselves; re-export it from its origin"


class IncompleteCheckpoint(CheckpointError):
    code = "incomplete_checkpoint"
    title = "Partially written checkpoint"
    default_hint = (
        "the writer did not finish (no __SUCCESS__ marker); use a complete checkpoint, or pass "
        "allow_incomplete to read it anyway"
    )


class UnsafeCheckpoint(CheckpointError):
    code = "unsafe_checkpoint"
    title = "Checkpoint refused: it would execute code"
    default_hint = (
        "this pickle references objects beyond plain tensors and containers; re-save it with "
        "torch.save(state_dict) of tensors only, or convert it to safetensors where it was made"
    )


class UnsupportedDtype(CheckpointError):
    code = "unsupported_dtype"
    title = "Unsupported dtype"
    default_hint = "cast the tensor first (--dtype) or choose a target format that can hold this dtype"


class UnsupportedValue(CheckpointError):
    code = "unsupported_value"
    title = "Value cannot be stored in the target format"


class KeyCollision(CheckpointError):
    code = "key_collision"
    title = "Two entries flatten to the same key"
    default_hint = "rename one of the colliding keys; a flat checkpoint key must be unique"


# --- conversion ------------------------------------------------------------------------------


class ConversionError(CkptconvError):
    code = "conversion_error"
    http_status = 422
    title = "Conversion failed"


class SinkProtocolError(ConversionError, RuntimeError):
    """A sink was driven against its contract (``begin``, every ``write`` in the announced order,
    then ``commit``): a fault of the calling code, never of the checkpoint."""

    code = "sink_protocol_error"
    http_status = 500
    title = "Checkpoint writer used out of order"


class UnmatchedKeys(ConversionError):
    code = "unmatched_keys"
    title = "Checkpoint keys not matched by the model layout"
    default_hint = "check --model and the formats, or pass drop_unmatched_keys to drop them"


class ConfigConversionError(ConversionError):
    code = "config_conversion_error"
    title = "Config cannot be converted"


class NoConversionPath(ConversionError):
    code = "no_conversion_path"
    title = "No conversion between these formats"
    default_hint = "run `ckptconv models` for the formats each model supports"


class VerificationFailed(ConversionError):
    code = "verification_failed"
    title = "Output does not match the source"
    default_hint = (
        "the written output differs from what was read; nothing was published. Retry; if it persists, report it"
    )


class Cancelled(CkptconvError):
    code = "cancelled"
    http_status = 409
    title = "Cancelled"


class TimeLimitExceeded(CkptconvError, TimeoutError):
    code = "time_limit_exceeded"
    http_status = 408
    title = "Time limit exceeded"
    default_hint = "raise max_runtime_seconds, or split the work"


class WorkerLost(CkptconvError):
    code = "worker_lost"
    http_status = 500
    title = "The job's worker was lost too many times"
    default_hint = "workers running this job died repeatedly (often: out of memory); give them more memory and resubmit"


class OutOfMemory(CkptconvError, MemoryError):
    """A value too large for this process's memory: no buffer for it could be allocated."""

    code = "out_of_memory"
    http_status = 507
    title = "A value does not fit in memory"
    default_hint = "run it where more memory is free (a single tensor is held whole), or check the source's shapes"


class LeaseLost(CkptconvError):
    """This attempt of a job is no longer the current one: another worker took the job over."""

    code = "lease_lost"
    http_status = 409
    title = "Another worker took this job over"
    default_hint = "nothing to do: the job continues on the worker that took it over"


class DataloaderStateError(ConversionError):
    code = "dataloader_state_error"
    title = "Dataloader state cannot be converted"


class SparsityStateError(ConversionError):
    code = "sparsity_state_error"
    title = "Sparsity state cannot be converted"


class SpecRepairError(ConversionError):
    code = "spec_repair_error"
    title = "Legacy checkpoint cannot be repaired"
    default_hint = "the checkpoint lacks data its tree spec lists; convert it from a complete copy"


class SimulationError(CkptconvError):
    code = "simulation_error"
    http_status = 422
    title = "Simulator error"


class LogitMismatch(SimulationError):
    """The simulator's model of a converted checkpoint computes other logits than the Hugging Face model."""

    code = "logit_mismatch"
    title = "Logits differ beyond the tolerance"
    default_hint = "the details carry the differences per output; check the model name, config and conversion"


class CheckpointMismatch(CheckpointError):
    """The checkpoint's model keys or shapes differ from the model its config describes."""

    code = "checkpoint_mismatch"
    title = "Checkpoint does not match the model"
    default_hint = (
        "check --model and the config against the checkpoint (the details list the keys); "
        "disable_strict_checkpoint_loading accepts extra and missing keys"
    )


def _subclasses(klass: type[CkptconvError]) -> list[type[CkptconvError]]:
    out = [klass]
    for sub in klass.__subclasses__():
        out.extend(_subclasses(sub))
    return out


def _index() -> None:
    _BY_NAME.clear()
    _BY_CODE.clear()
    for klass in _subclasses(CkptconvError):
        _BY_NAME[klass.__name__] = klass
        _BY_CODE.setdefault(klass.code, klass)


_BY_NAME: dict[str, type[CkptconvError]] = {}
_BY_CODE: dict[str, type[CkptconvError]] = {}
_index()


def register(klass: type[CkptconvError]) -> type[CkptconvError]:
    """Class decorator for errors defined outside this module (they must stay picklable by name)."""
    _BY_NAME[klass.__name__] = klass
    _BY_CODE.setdefault(klass.code, klass)
    return klass
