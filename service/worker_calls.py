"""Short synchronous round trips to a worker (dry runs, inspections) without importing the engine.

The API pushes a task message on the interactive queue naming a reply list, then waits on that
list with BLPOP; the worker pushes ``{"ok": true, "value": …}`` or ``{"ok": false, "problem": …}``.
The message expires with the wait, so a worker that picks it up late does not do stale work.
The wait holds a connection of the API's blocking pool, never one of the short commands'.
No Celery result backend is involved.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ckptconv.core.errors import CkptconvError, WorkerTimeout
from service.deps import AppState


async def call_worker(state: AppState, task: str, payload: dict[str, Any]) -> Any:
    timeout = state.settings.plan_timeout_seconds
    queue = state.settings.interactive_queue
    reply = state.keys.reply(uuid.uuid4().hex)
    message = state.messages.render(task, [reply, payload], queue=queue, expires_in=timeout)
    await state.messages.push(state.redis, queue, message)
    out = await state.blocking_redis.blpop([reply], timeout=timeout)
    if out is None:
        raise WorkerTimeout(f"no worker answered within {timeout:g} s")
    doc = json.loads(out[1])
    if doc.get("ok"):
        return doc["value"]
    raise CkptconvError.from_problem(doc["problem"])
