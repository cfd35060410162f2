"""The restricted unpickler: plain data in, nothing executed, everything else refused."""

from __future__ import annotations

import collections
import io
import os
import pickle
import subprocess

import numpy as np
import pytest
import torch

from ckptconv.core.errors import CorruptCheckpoint, UnsafeCheckpoint
from ckptconv.formats import restricted_pickle as rp

PLAIN = {
    "none": None,
    "bools": [True, False],
    "ints": [0, -1, 2**70],
    "floats": [0.1, float("inf")],
    "complex": 1 + 2j,
    "str": "h\u00e9llo",
    "bytes": b"\x00\xff",
    "bytearray": bytearray(b"ab"),
    "tuple": (1, (2, 3)),
    "set": {1, 2},
    "frozenset": frozenset({"a"}),
    "od": collections.OrderedDict(b=1, a=2),
    "deque": collections.deque([1, 2], maxlen=5),
    "range": range(3),
    "slice": slice(1, 5, 2),
    "int_keys": {0: "zero", -3: "minus"},
}


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_loads_at_every_protocol(protocol):
    assert rp.loads(pickle.dumps(PLAIN, protocol=protocol)) == PLAIN


def test_numbers_from_numpy_and_torch():
    data = {
        "i64": np.int64(7),
        "b": np.bool_(True),
        "f16": np.float16(0.5),
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "dtype": torch.bfloat16,
    }
    got = rp.loads(pickle.dumps(data, protocol=4))
    assert got["i64"] == 7 and got["i64"].dtype == np.int64 and got["b"] == np.bool_(True)
    assert got["f16"].dtype == np.float16
    assert np.array_equal(got["arr"], data["arr"]) and got["arr"].dtype == np.int32
    assert np.array_equal(got["fortran"], data["fortran"])
    assert got["dtype"] is torch.bfloat16


class _Evil:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize(
    "payload",
    [
        _Evil(os.system, "true"),
        _Evil(eval, "1+1"),
        _Evil(getattr, "os", "system"),
        _Evil(subprocess.Popen, ["true"]),
        _Evil(bytearray, 10**12),  # allowed type, refused argument: no giant allocation
        np.array([object()], dtype=object),
        _Evil(collections.namedtuple, "X", "a"),  # only pytree's marker, never the real factory
    ],
    ids=["os.system", "eval", "getattr", "popen", "bytearray-size", "object-array", "namedtuple-factory"],
)
def test_anything_else_is_refused(payload):
    data = pickle.dumps(payload, protocol=4)
    with pytest.raises(UnsafeCheckpoint):
        rp.loads(data)
    assert rp.try_loads(data) == (False, None)


def test_persistent_ids_and_garbage():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "ext" if obj == "x" else None

    buf = io.BytesIO()
    P(buf, protocol=4).dump(["x"])
    with pytest.raises(UnsafeCheckpoint, match="persistent"):
        rp.loads(buf.getvalue())
    for junk in (b"", b"\x80\x04garbage", pickle.dumps([1, 2])[:-3]):
        with pytest.raises(CorruptCheckpoint):
            rp.loads(junk)
        assert rp.try_loads(junk) == (False, None)


def test_error_names_the_global_and_the_payload():
    with pytest.raises(UnsafeCheckpoint) as info:
        rp.loads(pickle.dumps(_Evil(os.system, "true")), what="tree spec of x.mdl")
    assert "tree spec of x.mdl" in str(info.value) and "system" in str(info.value)
    assert info.value.details["global_name"].endswith(".system")


def test_dill_helpers_are_looked_up_in_tables():
    def fake(module: str, name: str, args: tuple) -> bytes:
        # GLOBAL module name, the arguments as a tuple, REDUCE
        return b"\x80\x04" + b"c" + f"{module}\n{name}\n".encode() + pickle.dumps(args, protocol=4)[2:-1] + b"R."

    assert rp.loads(fake("dill._dill", "_load_type", ("dict",))) is dict
    with pytest.raises(UnsafeCheckpoint):
        rp.loads(fake("dill._dill", "_load_type", ("FunctionType",)))
    point = rp.loads(fake("dill._dill", "_create_namedtuple", ("Point", ("x", "y"), "__main__")))
    assert point._fields == ("x", "y")
    with pytest.raises(UnsafeCheckpoint):
        rp.loads(fake("dill._dill", "_create_namedtuple", ("P", ("x; import os",), "m")))


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_deep_nesting_is_corrupt_at_every_protocol(protocol):
    # MARK x N, then LIST x N: [[[...]]] 5,000 deep (pickle.dumps itself would recurse too deeply).
    data = (b"\x80" + bytes([protocol]) if protocol >= 2 else b"") + b"(" * 5_000 + b"l" * 5_000 + b"."
    with pytest.raises(CorruptCheckpoint, match="nest"):
        rp.loads(data)
    assert rp.try_loads(data) == (False, None)


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_one_outcome_per_payload_whatever_the_protocol(protocol):
    assert rp.loads(pickle.dumps([1, 2, 3], protocol=protocol)) == [1, 2, 3]
    with pytest.raises(UnsafeCheckpoint) as info:
        rp.loads(pickle.dumps(_Evil(os.system, "true"), protocol=protocol))
    assert info.value.details["global_name"].endswith(".system")
