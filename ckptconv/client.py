"""Python client of the ckptconv service.

    from ckptconv.client import Client

    with Client("http://127.0.0.1:8000", api_key="ckc_...") as c:
        job = c.submit("s3://models/in.safetensors", "s3://models/out/model.mdl", to="cs-h5")
        job = c.wait(job["id"], on_progress=print)
        print(job["result"]["outputs"])

Errors come back as the ckptconv error the service raised (``CkptconvError.from_problem``), so
``except ObjectNotFound`` works across the network. ``base_url`` and ``api_key`` default to the
``CKPTCONV_URL`` and ``CKPTCONV_API_KEY`` environment variables.

Retries: a request that could not reach the service or lost its answer (connection errors), or
that was answered 429 or 503 (or 409 ``idempotent_request_in_flight``), is sent again up to
``retries`` times, after the ``Retry-After`` the service asked for or else an exponential backoff
with jitter. Every request is safe to send twice: reads and cancels are idempotent, and a
submission carries one ``Idempotency-Key`` for all of its attempts, so a retried submission whose
first answer was lost gets that first job back, never a second one.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ckptconv.core.errors import CkptconvError, RateLimited, ServiceUnavailable, TimeLimitExceeded
from ckptconv.core.webhooks import verify

DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = ("succeeded", "failed", "cancelled")
RETRY_STATUSES = (429, 503)
MAX_RETRY_AFTER_SECONDS = 300.0

Job = dict[str, Any]


class Client:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        retries: int = 6,
        backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 30.0,
    ) -> None:
        self.base_url = (base_url or os.environ.get("CKPTCONV_URL") or DEFAULT_URL).rstrip("/")
        self.retries = max(0, retries)
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        key = api_key if api_key is not None else os.environ.get("CKPTCONV_API_KEY")
        headers = {"user-agent": "ckptconv-client"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- plumbing

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One logical request: sent again on connection errors, 429 and 503 (see the module docstring)."""
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                if last:
                    raise ServiceUnavailable(
                        f"cannot reach the ckptconv service at {self.base_url}: {e}",
                        hint="check --url / CKPTCONV_URL and that `ckptconv serve` is running",
                    ) from None
                time.sleep(self._backoff(attempt))
                continue
            if last or not _retryable(response):
                break
            time.sleep(self._backoff(attempt, response.headers.get("retry-after")))
        if response.status_code >= 400:
            raise _error(response)
        return response

    def _backoff(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds before the next attempt: what the service asked for, else exponential with full jitter."""
        asked = _retry_after_seconds(retry_after)
        if asked is not None:
            return min(asked, MAX_RETRY_AFTER_SECONDS) + random.uniform(0, self.backoff_seconds)
        return random.uniform(0, min(self.max_backoff_seconds, self.backoff_seconds * 2**attempt))

    # -- jobs

    def submit(
        self,
        source: str,
        target: str | None = None,
        *,
        to: str | None = None,
        source_format: str | None = None,
        kind: str = "convert",
        options: dict[str, Any] | None = None,
        labels: dict[str, str] | None = None,
        webhook: dict[str, str] | None = None,
        max_runtime_seconds: int | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Submit a job; returns the job resource (state ``queued``).

        An idempotency key is generated when none is given, so the client's own retries never
        create a job twice.
        """
        body: dict[str, Any] = {"kind": kind, "source": {"uri": source}, "options": options or {}}
        if source_format:
            body["source"]["format"] = source_format
        if target is not None:
            body["target"] = {"uri": target, "format": to}
        if labels:
            body["labels"] = labels
        if webhook:
            body["webhook"] = webhook
        if max_runtime_seconds:
            body["max_runtime_seconds"] = max_runtime_seconds
        key = idempotency_key or f"ckptconv-client-{uuid.uuid4()}"
        return self._request("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}).json()

    def get(self, job_id: str) -> Job:
        return self._request("GET", f"/v1/jobs/{job_id}").json()

    def list(
        self,
        *,
        state: str | None = None,
        kind: str | None = None,
        labels: dict[str, str] | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Job], str | None]:
        """One page of jobs, newest first, and the cursor of the next page (None on the last)."""
        params: list[tuple[str, str | int]] = [("limit", limit)]
        if state:
            params.append(("state", state))
        if kind:
            params.append(("kind", kind))
        if cursor:
            params.append(("cursor", cursor))
        params += [("label", f"{k}:{v}") for k, v in (labels or {}).items()]
        doc = self._request("GET", "/v1/jobs", params=params).json()
        return doc["jobs"], doc["next_cursor"]

    def iter_jobs(self, **filters: Any) -> Iterator[Job]:
        cursor = None
        while True:
            page, cursor = self.list(cursor=cursor, **filters)
            yield from page
            if cursor is None:
                return

    def cancel(self, job_id: str) -> Job:
        return self._request("POST", f"/v1/jobs/{job_id}/cancel").json()

    def events(self, job_id: str, *, last_event_id: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-sent events of a job as (event, data) until the job ends."""
        headers = {"accept": "text/event-stream"}
        if last_event_id:
            headers["last-event-id"] = last_event_id
        try:
            with self._http.stream(
                "GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=httpx.Timeout(30.0, read=60.0)
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                event, data = "message", []
                for line in response.iter_lines():
                    if line == "":
                        if data:
                            yield event, json.loads("\n".join(data))
                        event, data = "message", []
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
        except httpx.TransportError as e:
            raise ServiceUnavailable(f"event stream from {self.base_url} broke: {e}") from None

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_progress: Callable[[Job], None] | None = None,
        poll_interval: float = 1.0,
    ) -> Job:
        """Block until the job ends; returns the final job. ``on_progress`` gets the job as it changes.

        Follows the event stream; falls back to polling if the stream breaks.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.get(job_id)
        if on_progress:
            on_progress(job)
        while job["state"] not in TERMINAL:
            try:
                for event, data in self.events(job_id):
                    if event == "job":
                        job = data
                    elif event == "progress":
                        job = {**job, "progress": data}
                    elif event == "state":
                        job = {**job, "state": data.get("state", job["state"])}
                    if on_progress:
                        on_progress(job)
                    if deadline is not None and time.monotonic() > deadline:
                        break
                    if job["state"] in TERMINAL and event == "job":
                        return job
            except (ServiceUnavailable, RateLimited):  # no stream now (e.g. too many open): poll
                time.sleep(poll_interval)
            job = self.get(job_id)
            if on_progress:
                on_progress(job)
            if deadline is not None and time.monotonic() > deadline and job["state"] not in TERMINAL:
                raise TimeLimitExceeded(f"job {job_id} still {job['state']} after {timeout:g} s")
        return job

    # -- dry runs and catalog

    def plan(
        self,
        source: str,
        target: str | None = None,
        *,
        to: str | None = None,
        source_format: str | None = None,
        kind: str = "convert",
        options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": kind, "source": {"uri": source}, "options": options or {}}
        if source_format:
            body["source"]["format"] = source_format
        if target is not None:
            body["target"] = {"uri": target, "format": to}
        return self._request("POST", "/v1/plans", json=body, timeout=None).json()

    def inspect(self, uri: str, *, source_format: str | None = None) -> dict[str, Any]:
        params = {"uri": uri, **({"format": source_format} if source_format else {})}
        return self._request("GET", "/v1/inspect", params=params, timeout=None).json()

    def formats(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/formats").json()["formats"]

    def kinds(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/kinds").json()["kinds"]


def _retryable(response: httpx.Response) -> bool:
    if response.status_code in RETRY_STATUSES:
        return True
    # The first request with this Idempotency-Key is still running: its answer comes on a retry.
    return (
        response.status_code == 409
        and response.headers.get("content-type", "").startswith("application/problem+json")
        and _code(response) == "idempotent_request_in_flight"
    )


def _code(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("code") if isinstance(body, dict) else None


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date (RFC 9110); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error(response: httpx.Response) -> CkptconvError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "code" in body:
        return CkptconvError.from_problem(body)
    # Not the service's own answer (a proxy or load balancer in front of it): typed by status.
    klass = {429: RateLimited, 502: ServiceUnavailable, 503: ServiceUnavailable, 504: ServiceUnavailable}
    return klass.get(response.status_code, CkptconvError)(
        f"HTTP {response.status_code} from {response.request.url}: {response.text[:200]}"
    )


def verify_webhook(
    secret: str, headers: dict[str, str], body: bytes, *, tolerance_seconds: int = 300
) -> dict[str, Any]:
    """Check a completion webhook's Standard Webhooks signature; returns the parsed event."""
    verify(secret, headers, body, tolerance_seconds=tolerance_seconds)
    return json.loads(body)
