"""A publication killed while it copies an S3 object in parts, or between two files, simulated in process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ckptconv.storage import open_storage


class Killed(BaseException):
    """What a SIGKILL does to a publication, in process: it stops where it is."""


def lower_copy_threshold(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of over 5 MiB in 5 MiB parts (5 GiB in production), for the instance every step of a
    job on ``bucket`` uses."""
    storage = open_storage(f"s3://{bucket}/")
    monkeypatch.setattr(storage, "multipart_copy_threshold", 5 << 20)
    monkeypatch.setattr(storage, "copy_part_size", 5 << 20)


@contextmanager
def killed_at_the_second_part(bucket: str) -> Iterator[None]:
    """Inside, a publication stops at its second part copy raising :class:`Killed`, and aborts and
    removes nothing (a killed process runs no cleanup): its upload stays at the final key."""
    storage = open_storage(f"s3://{bucket}/")
    copy_part = storage.client.upload_part_copy

    def killed(**kwargs: object) -> dict:
        if kwargs["PartNumber"] == 2:
            raise Killed
        return copy_part(**kwargs)

    with pytest.MonkeyPatch.context() as m, pytest.raises(Killed):
        m.setattr(storage.client, "upload_part_copy", killed)
        m.setattr(storage, "_abort_upload", lambda *args: None)
        m.setattr("ckptconv.engine.publish._unpublish", lambda *args: False)
        yield


@contextmanager
def killed_after_the_first_file(target: str) -> Iterator[None]:
    """Inside, a publication to ``target``'s storage stops as it starts placing its second file,
    raising :class:`Killed`, and removes nothing: the first file stays at its final name."""
    storage_class = type(open_storage(target))
    publish = storage_class.publish
    calls: list[object] = []

    def killed(self: object, pairs: object, **kwargs: object) -> None:
        calls.append(pairs)
        if len(calls) == 2:
            raise Killed
        publish(self, pairs, **kwargs)

    with pytest.MonkeyPatch.context() as m, pytest.raises(Killed):
        m.setattr(storage_class, "publish", killed)
        m.setattr("ckptconv.engine.publish._unpublish", lambda *args: False)
        yield
