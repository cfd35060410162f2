"""The ckptconv HTTP API (FastAPI). Start it with ``ckptconv serve`` or
``uvicorn --factory service.app:create_app``.

This process never imports torch, h5py or tensorflow: work that needs them is done by workers
(jobs through the queue; dry runs and inspections through ``service.worker_calls``).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ckptconv import __version__
from ckptconv.core.auth import KeyRegistry, load_keys_file
from ckptconv.core.jobstore import AsyncJobStore, RedisKeys
from ckptconv.core.settings import Settings, get_settings
from service import problems
from service.deps import BEARER_SCHEME, AppState
from service.edges import EdgesFirst
from service.hot import HotPaths
from service.limits import BoundedPool, RateLimiter, StreamSlots, redis_retry
from service.multiplexer import MultiplexedRedis
from service.queue import TaskMessages
from service.routes import catalog, dashboard, health, jobs, models, plans
from service.schemas.common import PROBLEM_JSON, Problem, problem_responses
from service.targets import warm_up

DESCRIPTION = """\
Convert deep-learning checkpoints between formats, as long-running jobs.

Submit a job (`POST /v1/jobs`, answered `202` with a `Location`), then follow it: poll
`GET /v1/jobs/{id}`, or stream `GET /v1/jobs/{id}/events`. A finished job has `done: true` and
either a `result` (outputs with sizes and BLAKE3 digests, the manifest's URI, warnings) or an `error`.
Every error is an RFC 9457 problem document (`application/problem+json`) with a stable `code`.

Authenticate with an API key: `Authorization: Bearer ckc_…`. A key may only name URIs under its
prefixes and sees only its own jobs. `Idempotency-Key` makes submissions safe to retry.
"""


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, with every error response declared as a problem document."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title="ckptconv", version=__version__, description=DESCRIPTION, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    doc["components"]["securitySchemes"] = {"bearer": BEARER_SCHEME}
    ref = {"$ref": "#/components/schemas/Problem"}
    for path_item in doc.get("paths", {}).values():
        for op in path_item.values():
            responses = op.get("responses", {})
            if "401" in responses:  # service.edges: every authenticated route answers these two
                op["security"] = [{"bearer": []}]
                responses.setdefault("429", problem_responses(429)[429])
            if "requestBody" in op:  # service.edges: a body too large, or not received in time
                responses.setdefault("408", problem_responses(408)[408])
                responses.setdefault("413", problem_responses(413)[413])
            for code, response in op.get("responses", {}).items():
                if code == "default" or int(code) >= 400:
                    response["content"] = {PROBLEM_JSON: {"schema": ref}}
                    if code == "422":
                        response["description"] = "Invalid request"
    app.openapi_schema = doc
    return doc


def read_model_tables() -> None:
    """Read the model tables that a convert-model request's options are checked against
    (:class:`~ckptconv.jobs.kinds.ConvertModelOptions`) now, not in the first such request, whose
    validation runs on the event loop: 0.2 s there, with nothing else answered meanwhile."""
    from ckptconv.engine.layouts.registry import model_index, model_tables

    model_index()
    model_tables()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: EdgesFirst) -> AsyncIterator[None]:
        import redis.asyncio

        def client(max_connections: int, kind: type[redis.asyncio.Redis] = redis.asyncio.Redis) -> Any:
            # After a Redis restart every pooled connection is dead; without a retry each one failed
            # its next command once (a 503 per connection). A command is resent on a fresh connection
            # only after a connection error, i.e. when it did not reach the server or its reply was
            # lost; the submit script stays safe to resend: an Idempotency-Key replay returns its job
            # and the target reservation refuses a second one.
            pool = BoundedPool.from_url(
                settings.redis_url,
                decode_responses=True,
                socket_connect_timeout=5,
                max_connections=max_connections,
                timeout=settings.redis_pool_timeout_seconds,
                retry=redis_retry(),
                retry_on_error=[redis.exceptions.ConnectionError],
            )
            return kind.from_pool(pool)

        # Short commands share one connection, written once per event-loop iteration (service.multiplexer).
        short = client(settings.redis_max_connections, MultiplexedRedis)
        blocking = client(settings.redis_blocking_connections)
        keys = RedisKeys(settings.redis_prefix, settings.broker_prefix)
        file_keys = load_keys_file(settings.api_keys_file) if settings.api_keys_file else {}
        app.state.ckptconv = app.ckptconv = AppState(
            settings=settings,
            redis=short,
            keys=keys,
            store=AsyncJobStore(short, keys, retention_seconds=settings.job_retention_seconds),
            auth=KeyRegistry(short, keys, file_keys=file_keys, cache_seconds=settings.auth_cache_seconds),
            messages=TaskMessages(keys),
            limiter=RateLimiter(short, keys, settings.rate_limit_per_second),
            streams=StreamSlots(short, keys, settings.max_streams_per_key),
            blocking_redis=blocking,
        )
        await asyncio.to_thread(warm_up)  # before the first request, which may be a burst
        await asyncio.to_thread(read_model_tables)
        if settings.gc_freeze:
            # Everything allocated so far lives as long as the process: keep it out of collections,
            # and collect less often (full collections were the p99 latency; see measurements).
            gc.collect()
            gc.freeze()
            gc.set_threshold(50_000, 20, 100)
        try:
            yield
        finally:
            await short.aclose()
            await blocking.aclose()

    app = EdgesFirst(
        hot=HotPaths(),
        title="ckptconv",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    problems.install(app)
    for router in (jobs.router, plans.router, catalog.router, models.router, health.router, dashboard.router):
        app.include_router(router)
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]
    return app
