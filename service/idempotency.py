"""Idempotency-Key handling (after the IETF httpapi draft, as Stripe does it).

A key is scoped to the API key that sent it and remembered for ``idempotency_ttl_seconds``:

- same key, same request (method, path, validated body): the first response is replayed, byte for
  byte, with ``Idempotent-Replayed: true``;
- same key, different request: 422 ``idempotency_key_reused``;
- same key while the first request is still being processed: 409 ``idempotent_request_in_flight``.

Job creation records its response in the same Redis script that creates the job (there is no
window in which it is "in flight"); other requests claim the key first, then store the response
(2xx and 4xx are stored; after a 5xx the claim is released so that a retry runs again). A claim
holds a token of its request: the claim sent again after its reply was lost (``service.multiplexer``
resends the commands of a lost connection) finds its own token and is claimed, not "in flight";
a release, or the recording of an answer, acts only on a claim holding its own token, never on the
claim of another request that took the key after this one's claim lapsed (or after a resent release).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from ckptconv.core.errors import CkptconvError, IdempotencyMismatch, IdempotentRequestInFlight
from service.deps import AppState
from service.problems import problem_response
from service.schemas.common import PROBLEM_JSON

PENDING_SECONDS = 600  # a claim outlives any request the API waits for


def replay(stored: list[str], fingerprint: str) -> Response:
    """The response for a key already seen (``stored`` as the Redis scripts return it)."""
    _, prev_fp, status, code, body, location = stored
    if prev_fp != fingerprint:
        raise IdempotencyMismatch("this Idempotency-Key was used with a different request")
    if status != "done":
        raise IdempotentRequestInFlight("the first request with this Idempotency-Key is still being processed")
    headers = {"Idempotent-Replayed": "true"}
    if location:
        headers["Location"] = location
    status_code = int(code)
    media = PROBLEM_JSON if status_code >= 400 else "application/json"
    return Response(body, status_code=status_code, headers=headers, media_type=media)


async def idempotent(
    state: AppState,
    request: Request,
    record_key: str | None,
    fingerprint: str,
    produce: Callable[[], Awaitable[Response]],
) -> Response:
    """Run ``produce`` at most once per key (see the module docstring)."""
    if record_key is None:
        return await produce()
    token = uuid.uuid4().hex
    stored = await state.store.idem_claim(record_key, fingerprint, PENDING_SECONDS, token)
    if stored[0] == "exists":
        return replay(stored, fingerprint)
    try:
        response = await produce()
    except CkptconvError as e:
        if e.http_status >= 500:
            await state.store.idem_release(record_key, token)
            raise

        response = problem_response(e, request.url.path, method=request.method)
    except BaseException:
        await state.store.idem_release(record_key, token)
        raise
    ttl = state.settings.idempotency_ttl_seconds
    await state.store.idem_complete(record_key, token, response.status_code, bytes(response.body).decode(), "", ttl)
    return response
