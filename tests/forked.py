"""Running a step that may hang (a library loop holding the GIL) in a forked child, so that a test
fails instead of hanging the suite."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def _report(fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    from ckptconv.core.errors import CkptconvError

    try:
        fn(*args)
        results.put("ok")
    except CkptconvError as e:
        results.put(type(e).__name__)
    except BaseException as e:  # an untyped error
        results.put(f"UNTYPED {type(e).__name__}: {e}")


def outcome_in_child(fn: Callable[..., Any], *args: Any, timeout: float = 60) -> str | None:
    """How ``fn(*args)`` ended in a forked child: "ok", the name of the ckptconv error it raised, or
    "UNTYPED <type>: <message>"; None when it was still running after ``timeout`` seconds (killed)."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_report, args=(fn, args, results))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return None
    return results.get(timeout=10)
