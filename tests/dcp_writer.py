"""Distributed checkpoints written by torch's own ``torch.distributed.checkpoint``, in one process.

A training run saves each tensor as the chunks its ranks hold. ``save_dcp`` produces the same files
from one process through DCP's planner extension point: :class:`ChunkingPlanner` splits the write
items of chosen tensors into chunks (as FSDP/tensor-parallel ranks would) and hands DCP each chunk
when it resolves the data; everything else -- metadata, ``.distcp`` files, global plan validation
-- is DCP's default path. ``thread_count`` spreads the records over several ``.distcp`` files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

Chunking = dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]  # fqn -> [(offsets, sizes)]


def grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The chunks of ``shape`` split evenly into ``parts[d]`` pieces along each dim d."""
    ranges = []
    for size, n in zip(shape, parts, strict=True):
        step = -(-size // n)
        ranges.append([(o, min(step, size - o)) for o in range(0, size, step)])
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for dim_ranges in ranges:
        out = [((*off, o), (*siz, s)) for off, siz in out for o, s in dim_ranges]
    return out


class ChunkingPlanner(DefaultSavePlanner):
    def __init__(self, chunks: Chunking) -> None:
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            if item.index.fqn not in self.chunks or item.tensor_data is None:
                items.append(item)
                continue
            for offsets, sizes in self.chunks[item.index.fqn]:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items.append(
                    WriteItem(
                        index=MetadataIndex(item.index.fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk, item.tensor_data.properties, item.tensor_data.size),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn not in self.chunks:
            return super().lookup_object(index)
        tensor = self.state_dict[index.fqn]
        sizes = dict(self.chunks[index.fqn])[tuple(index.offset)]
        for dim, (o, s) in enumerate(zip(index.offset, sizes, strict=True)):
            tensor = tensor.narrow(dim, o, s)
        return tensor.clone()  # a rank holds its chunk in its own storage


def save_dcp(
    state_dict: dict[str, Any], path: Path, chunks: Chunking | None = None, thread_count: int = 2, **writer: Any
) -> Path:
    """``writer``: more FileSystemWriter options (``serialization_format=...``)."""
    storage_writer = dcp.FileSystemWriter(str(path), thread_count=thread_count, **writer)
    dcp.save(state_dict, storage_writer=storage_writer, planner=ChunkingPlanner(chunks or {}), no_dist=True)
    return path
