"""Write checkpoints with the real ``cerebras.pytorch.save`` and describe them (oracle venv only).

Usage: ``save_vectors.py OUTDIR``

Writes ``OUTDIR/NAME.mdl`` for every vector below (cs-checkpoint-format §7 vectors 1-6, every
dtype, awkward keys, numpy arrays, a model-like trainer checkpoint) and ``OUTDIR/vectors.json``:
``{NAME: {"file", "note", "expected", "ties_in_input", "loaded", "ties_after_load", "error"}}``
where ``expected`` describes the state dict that was saved and ``loaded`` what ``cstorch.load``
returned for the file (the reference a compatible reader must reproduce; see describe_tree.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import cerebras.pytorch as cstorch  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from cerebras.appliance.data.dtypes import bf16 as NP_BF16  # noqa: E402
from describe_tree import describe, ties  # noqa: E402


@dataclasses.dataclass
class RunConfig:  # an arbitrary user object: stored as a dill payload
    lr: float = 0.1
    name: str = "run"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def v1_dtypes_layout() -> dict:
    g = gen(1)
    return {
        "model": {
            "w": torch.randn(2, 3, generator=g).to(torch.bfloat16),
            "b": torch.randn(3, generator=g).to(torch.float16),
            "m": torch.tensor([True, False]),
            "i": torch.arange(4),
            "s": torch.tensor(1.5),
            "e": torch.zeros(0),
        },
        "global_step": 10,
    }


def v2_tied() -> dict:
    emb = torch.randn(8, 4, generator=gen(2)).to(torch.bfloat16)
    return {"model": {"emb": {"weight": emb}, "body": torch.ones(2), "lm_head": {"weight": emb}}}


def v3_singletons() -> dict:
    return {"a": None, "b": None, "c": 1, "d": 1, "t": True}


def v4_containers() -> dict:
    return {
        "l": [],
        "d": {},
        "t": (1, "x"),
        "od": collections.OrderedDict(z=2),
        "n": [[], [3.5]],
        "s": {7, 8},
        "deep": {"e": (), "f": [{}], "g": collections.OrderedDict()},
    }


def v5_int_keys() -> dict:
    return {
        "state": {0: {"step": torch.tensor(3.0)}, 1: {"step": torch.tensor(3.0)}, -3: {"x": 1}},
        "param_groups": [{"params": [0, 1], "lr": 1e-3}],
    }


def v6_values_objects() -> dict:
    blob = bytes(range(256)) * 300  # > 64 KiB: dense attribute storage
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    return {
        "str": "h\u00e9llo \u2713 \u4e16\u754c",
        "str_empty": "",
        "nan": float("nan"),
        "inf": float("inf"),
        "ninf": float("-inf"),
        "neg_zero": -0.0,
        "big": 2**70,
        "neg_big": -(2**65),
        "np_float": np.float64(0.25),
        "dtype": torch.bfloat16,
        "np_int": np.int64(7),
        "np_bool": np.bool_(True),
        "blob": blob,
        "small_bytes": b"\x00\x01",
        "config": RunConfig(),
        "arr": arr,
        "arr_T": arr.T,
        "arr_0d": np.array(2.5),
        "arr_empty": np.zeros((0, 3), np.int32),
        "arr_bf16": np.array([0x3F80, -0x4000, 0x7FC0], dtype=np.int16).astype(NP_BF16),
        "arr_u16": np.array([0, 65535], np.uint16),
    }


def all_dtypes() -> dict:
    g = gen(7)
    base = torch.randn(3, 5, generator=g)
    ints = torch.randint(-1000, 1000, (3, 5), generator=g)
    out: dict = {
        "f32": base,
        "f64": base.double() * 3,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "bool": base > 0,
        "i16": ints.to(torch.int16),
        "i32": ints.to(torch.int32) * 1000,
        "i64": ints * 10**12,
        "u8": torch.randint(0, 256, (3, 5), generator=g).to(torch.uint8),
        "u16": torch.from_numpy(np.array([[0, 1, 65535], [7, 30000, 2]], np.uint16)),
        "u32": torch.from_numpy(np.array([0, 2**32 - 1, 12345], np.uint32)),
        "u64": torch.from_numpy(np.array([0, 2**64 - 1, 2**40], np.uint64)),
        "f32_T": base.t(),
        "f32_4d": torch.randn(2, 3, 1, 4, generator=g),
        "bf16_special": torch.tensor(
            [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3e38, -2.5]
        ).bfloat16(),
        "f16_special": torch.tensor([0.0, -0.0, float("inf"), float("nan"), 6e-8, 65504.0]).half(),
        "chunked_f32": torch.randn(300, 700, generator=g),
        "chunked_i16": torch.randint(-30000, 30000, (1000, 1000), generator=g).to(torch.int16),
    }
    for name in ("f32", "f64", "f16", "bf16", "bool", "i64", "u8", "i32"):
        dt = out[name].dtype
        out[f"{name}_0d"] = out[name].reshape(-1)[3].clone()
        out[f"{name}_empty"] = torch.zeros(0, dtype=dt)
        out[f"{name}_empty2"] = torch.zeros(2, 0, dtype=dt)
    return out


def awkward_keys() -> dict:
    shared = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    pair = torch.randn(4, generator=gen(9)).bfloat16()
    return {
        "key.with.dots": torch.ones(1),
        "slash/key": torch.zeros(2),
        "x": {"v/w": 1, "deeper/still": {"t": torch.ones(3, dtype=torch.int32)}},
        "neg": {-1: "minus one", 0: shared, 10: [shared, {"again": shared}]},
        "bf16_a": pair,
        "bf16_b": pair,
        "list_of_ties": [pair, shared, pair],
        "space key": "value with spaces",
        "unicode_k\u00e9y": 3,
    }


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(dim), "fc": torch.nn.Linear(dim, dim)}) for _ in range(3)
        )
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embedding.weight  # tied, as in many LMs

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for b in self.blocks:
            x = x + b["fc"](b["ln"](x))
        return self.lm_head(x)


def model_like() -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    ids = torch.randint(0, 16, (2, 5), generator=gen(3))
    for _ in range(3):
        opt.zero_grad()
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        sched.step()
    sd = collections.OrderedDict((f"model.{k}", v) for k, v in model.state_dict().items())
    # state_dict() detaches each occurrence separately; a trainer that keeps the tie saves one object.
    sd["model.lm_head.weight"] = sd["model.embedding.weight"]
    return {
        "model": sd,
        "optimizer": opt.state_dict(),
        "schedulers": [sched.state_dict()],
        "global_step": 3,
        "__metadata__": [
            {
                "version": cstorch.__version__,
                "model_name": "TinyLM",
                "params": {"model": {"vocab_size": 16, "hidden_size": 8, "dropout": 0.0, "act": None}},
            }
        ],
    }


VECTORS = {
    "v1_dtypes_layout": ("§7.1 dtypes, 0-d and zero-size, global_step", v1_dtypes_layout),
    "v2_tied": ("§7.2 one bf16 tensor at two keys", v2_tied),
    "v3_singletons": ("§7.3 None/1 singletons become links", v3_singletons),
    "v4_containers": ("§7.4 empty containers, tuple, OrderedDict, set", v4_containers),
    "v5_int_keys": ("§7.5 optimizer-style int keys", v5_int_keys),
    "v6_values_objects": ("§7.6 strings, NaN/inf, big ints, dill objects, numpy arrays", v6_values_objects),
    "all_dtypes": ("every dtype cstorch stores, 0-d/empty variants, specials, multi-chunk", all_dtypes),
    "awkward_keys": ("dotted, slash, negative int, unicode keys; ties in lists", awkward_keys),
    "model_like": ("trainer checkpoint: model (tied), AdamW, LinearLR, global_step, __metadata__", model_like),
}


def main(outdir: str) -> int:
    os.makedirs(outdir, exist_ok=True)
    result = {}
    for name, (note, make) in VECTORS.items():
        tree = make()
        path = os.path.join(outdir, f"{name}.mdl")
        rec = {"file": f"{name}.mdl", "note": note, "expected": describe(tree), "ties_in_input": ties(tree)}
        try:
            cstorch.save(tree, path)
            loaded = cstorch.load(path)
            rec.update(loaded=describe(loaded), ties_after_load=ties(loaded), error=None)
        except Exception as e:
            rec.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        result[name] = rec
    meta = {"cstorch": cstorch.__version__, "torch": torch.__version__}
    with open(os.path.join(outdir, "vectors.json"), "w") as f:
        json.dump({"writer": meta, "vectors": result}, f, indent=1)
    failed = [n for n, r in result.items() if r["error"]]
    print(f"{len(result) - len(failed)} vectors saved, {len(failed)} failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
