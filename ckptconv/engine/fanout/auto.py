"""``parallelism: "auto"``: how many parts a conversion is cut into, from its output bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckptconv.engine.fanout.run import FANOUT_FORMATS
from ckptconv.formats import sink_class
from ckptconv.formats.base import given_options

MAX_PARTS = 256  # parts of one job: each is a message, a lease and a record in staging
AUTO_PART_BYTES = 2 << 30  # one part per this many output bytes
AUTO_MAX_PARTS = 16  # more parts than workers only adds requests and tensors read twice


@dataclass(frozen=True)
class AutoParallelism:
    """What ``"auto"`` picks from: bytes per part, and the most parts (never more than 256)."""

    part_bytes: int = AUTO_PART_BYTES
    max_parts: int = AUTO_MAX_PARTS


def resolve_parallelism(
    requested: int | str,
    total_bytes: int,
    to: str,
    auto: AutoParallelism | None = None,
    sink_options: dict[str, Any] | None = None,
) -> int:
    """The number of parts: ``requested`` as given, or for ``"auto"`` one part per
    ``auto.part_bytes`` of output, capped by ``auto.max_parts`` and 256; 1 for a format whose
    layout is not known up front, with the sink's options (auto never asks for what the format refuses)."""
    if requested != "auto":
        return int(requested)
    if to not in FANOUT_FORMATS or sink_class(to).unsplittable(given_options(sink_options)):
        return 1
    auto = auto or AutoParallelism()
    wanted = math.ceil(max(total_bytes, 1) / max(auto.part_bytes, 1))
    return max(1, min(wanted, auto.max_parts, MAX_PARTS))
