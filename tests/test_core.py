"""The torch-free bottom layer: releases, dtypes and sizes, each read in one place."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ckptconv.core.dtypes import DTYPE_SIZES, FLOAT8_DTYPES, is_float_dtype
from ckptconv.core.releases import known_release, newer_than_known, parse_release, release_key, release_name
from ckptconv.engine.plan import identity_plan
from ckptconv.formats.base import Entry, torch_dtype


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.4.0", (2, 4)), ("2.10.0+abc", (2, 10)), (b"1.9.1", (1, 9)), ("2.4", (2, 4)), ("x2.4", None), ("", None)],
)
def test_parse_release(version: object, expected: tuple[int, int] | None) -> None:
    assert parse_release(version) == expected


def test_release_names() -> None:
    assert release_name("2.10.0") == "2.10" and known_release("2.10.0") is None and known_release("2.4.1") == "2.4"
    assert newer_than_known("2.10.0") == "2.10" and newer_than_known("2.4.0") is None
    with pytest.raises(ValueError):
        release_key("cs-2.4")


def test_float8_is_a_float_everywhere() -> None:
    assert {"float8_e4m3fn", "float8_e5m2"} == FLOAT8_DTYPES
    assert all(is_float_dtype(d) for d in FLOAT8_DTYPES)
    assert not is_float_dtype("int8") and not is_float_dtype("bool") and not is_float_dtype(None)
    for name, size in DTYPE_SIZES.items():
        assert torch.empty((), dtype=torch_dtype(name)).element_size() == size
    plan = identity_plan(
        [Entry("w", "tensor", "float8_e4m3fn", (2,)), Entry("n", "tensor", "int8", (2,))], None, dtype="bfloat16"
    )
    assert [s.out.dtype for s in plan.steps] == ["bfloat16", "int8"]


def test_core_imports_no_heavy_dependency() -> None:
    code = (
        "import sys, ckptconv.core.dtypes, ckptconv.core.releases, ckptconv.core.sizes;"
        "print(sorted(m for m in ('torch', 'numpy', 'h5py', 'fastapi') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
