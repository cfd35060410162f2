"""The error hierarchy: stable codes, statuses and hints, built-in bases, and the trip through pickle
and problem documents."""

from __future__ import annotations

import pickle

import pytest

from ckptconv.core import errors
from ckptconv.core.errors import CkptconvError, ObjectNotFound, StorageError, TargetExists
from ckptconv.storage.local import LocalStorage

ALL = errors._subclasses(CkptconvError)

# The built-in exception each class is also (inherited ones included); None: none beyond Exception.
BUILTIN_BASE: dict[str, type[Exception] | None] = {
    "InvalidRequest": ValueError,
    "UnknownFormat": ValueError,
    "UnknownModel": ValueError,
    "IdempotencyMismatch": ValueError,
    "UnknownJobKind": ValueError,
    "WebhookRefused": ValueError,
    "NotFound": LookupError,
    "WorkerTimeout": TimeoutError,
    "StorageUnavailable": OSError,
    "StorageError": OSError,
    "ObjectNotFound": FileNotFoundError,
    "TargetExists": FileExistsError,
    "PathEscape": ValueError,
    "CheckpointError": ValueError,
    "UnsupportedFormat": ValueError,
    "CorruptCheckpoint": ValueError,
    "LinkCycle": ValueError,
    "IncompleteCheckpoint": ValueError,
    "UnsafeCheckpoint": ValueError,
    "UnsupportedDtype": ValueError,
    "UnsupportedValue": ValueError,
    "KeyCollision": ValueError,
    "CheckpointMismatch": ValueError,
    "TimeLimitExceeded": TimeoutError,
    "OutOfMemory": MemoryError,
}
BROAD = (ValueError, OSError, LookupError, TimeoutError)


@pytest.mark.parametrize("klass", ALL, ids=lambda k: k.__name__)
def test_every_error_keeps_its_contract_and_builtin_base(klass: type[CkptconvError]) -> None:
    assert klass.code and klass.title and 400 <= klass.http_status < 600
    e = klass("what went wrong", hint="what to do", uri="s3://b/k")
    assert (e.code, e.http_status) == (klass.code, klass.http_status)
    assert (e.message, e.hint) == ("what went wrong", "what to do")
    assert str(e) == "what went wrong (what to do)"
    assert klass(klass.__name__).hint == klass.default_hint

    base = BUILTIN_BASE.get(klass.__name__)
    if base is None:
        assert not isinstance(e, BROAD), f"{klass.__name__} gained a built-in base the table does not list"
    else:
        assert isinstance(e, base)
        with pytest.raises(base):
            raise e
    assert isinstance(e, CkptconvError)

    # Celery pickles errors between processes; the API rebuilds them from stored problem documents.
    for back in (pickle.loads(pickle.dumps(e)), CkptconvError.from_problem(e.to_problem())):
        assert type(back) is klass
        assert (back.message, back.hint, back.details["uri"]) == ("what went wrong", "what to do", "s3://b/k")
        if base is not None:
            assert isinstance(back, base)


def test_the_table_names_only_existing_classes() -> None:
    assert set(BUILTIN_BASE) <= {k.__name__ for k in ALL}


def test_problem_document_is_unchanged_by_the_builtin_base() -> None:
    body = ObjectNotFound("no object at s3://b/k", uri="s3://b/k").to_problem()
    assert body == {
        "type": "https://ckptconv.dev/problems/object_not_found",
        "title": "Object not found",
        "status": 404,
        "code": "object_not_found",
        "detail": "no object at s3://b/k",
        "hint": "check the URI: nothing exists there",
        "details": {"uri": "s3://b/k"},
    }


def test_local_storage_errors_stay_typed_through_the_os_error_translation(tmp_path) -> None:
    storage = LocalStorage()
    missing = str(tmp_path / "missing.bin")
    with pytest.raises(FileNotFoundError) as caught:
        storage.stat(missing)
    assert type(caught.value) is ObjectNotFound

    target = str(tmp_path / "target.bin")
    late = storage.open_writer(target)
    late.write(b"second")
    with storage.open_writer(target) as first:
        first.write(b"first")
    # The commit finds the target taken; TargetExists is a FileExistsError, and the OSError
    # translation around the commit lets it through unchanged.
    for writer in (late, storage.open_writer):
        with pytest.raises(TargetExists) as exists:
            writer.commit() if writer is late else writer(target)
        assert type(exists.value) is TargetExists
    assert not isinstance(exists.value, StorageError)
    assert storage.read_range(target, 0, 5) == b"first"
