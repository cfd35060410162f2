"""What a layout step's work holds at its peak stays within what its transform announces
(``Transform.peak_factor`` times its output), the term of the plan's memory estimate that covers it:
a muP scale, a LoRA fold, a sparsity mask and NaN zeroing, each measured in this process's
resident size (VmHWM, reset before each run)."""

from __future__ import annotations

import gc
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.engine.layouts.folding import LoraSite
from ckptconv.engine.layouts.steps import Pre, lora_pre, make_step, masked, scaled, zero_nans
from ckptconv.engine.layouts.transforms import TRANSFORMS
from ckptconv.formats.base import Entry

MiB = 1 << 20
ROWS, COLS, RANK = 4096, 8192, 16  # a bf16 weight of 64 MiB: every temporary is mapped and unmapped
# Allocator bookkeeping and torch's own small buffers.
SLACK = 8 * MiB

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="resets and reads VmHWM through /proc"
)


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _transient(fn: Any, values: list[Any]) -> int:
    """The most bytes ``fn(values)`` added to this process while it ran, its result included."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    out = fn(values)
    peak = _status("VmHWM")
    del out
    return peak - base


def _weight(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(ROWS, COLS).to(dtype)


def _entries(values: dict[str, torch.Tensor]) -> dict[str, Entry]:
    return {k: Entry(k, "tensor", str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in values.items()}


def _case(name: str) -> tuple[list[Pre], dict[str, torch.Tensor]]:
    w = _weight(torch.float8_e4m3fn if name == "NaN->0 float8" else torch.bfloat16)
    values = {"w": w}
    site = LoraSite("w", "a", "b", 0.5, fan_in_fan_out=False, embedding=False)
    if name == "muP scale":
        return [scaled(Pre(("w",)), 0.25, "scale")], values
    if name.startswith("NaN->0"):
        return [Pre(("w",))], values
    values |= {"a": torch.randn(RANK, COLS), "b": torch.randn(ROWS, RANK)}
    if name == "LoRA fold":
        return [lora_pre(("w", "a", "b"), site)], values
    values["mask"] = torch.rand(ROWS, COLS) > 0.5
    if name == "LoRA fold, masked, scaled":
        return [scaled(masked(lora_pre(("w", "a", "b"), site), "mask"), 0.25, "scale")], values
    return [masked(Pre(("w",)), "mask")], values


@pytest.mark.parametrize(
    "name", ["muP scale", "LoRA fold", "masked", "LoRA fold, masked, scaled", "NaN->0 bf16", "NaN->0 float8"]
)
def test_a_layout_steps_work_stays_within_its_peak_factor(name: str) -> None:
    pres, values = _case(name)
    step = make_step("out", pres, TRANSFORMS["copy"].to_cs, {}, 0, "copy", 0.0, _entries(values))
    if name.startswith("NaN->0"):
        step = zero_nans(step)
    inputs = [values[k] for k in step.inputs]
    announced = int(step.transform.peak_factor * step.out.nbytes)
    measured = _transient(step.transform, inputs)
    assert measured <= announced + SLACK, (name, measured / MiB, announced / MiB)
    # Not vacuous: the work holds at least its result.
    assert measured >= step.out.nbytes - SLACK, (name, measured / MiB)
