"""Tensor transforms: each checked against a direct computation, and each export inverting its import."""

from __future__ import annotations

import math

import pytest
import torch

from ckptconv.engine.layouts.transforms import TRANSFORMS, alibi_slopes, lora_fold, rope_permute


def _to_cs(name: str, values: list[torch.Tensor], index: int = 0, **params) -> torch.Tensor:
    return TRANSFORMS[name].to_cs(values, params, index)


def _to_hf(name: str, values: list[torch.Tensor], index: int = 0, **params) -> torch.Tensor:
    return TRANSFORMS[name].to_hf(values, params, index)


# --- rotary -------------------------------------------------------------------------------------


def rope_rotate_half(x: torch.Tensor, pos: torch.Tensor, r: int, base: float = 10000.0) -> torch.Tensor:
    """Hugging Face style: pairs (i, i + r/2) of the first r dims, x * cos + rotate_half(x) * sin."""
    inv = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = pos[:, None].double() * inv[None]  # [T, r/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    xr, xp = x[..., :r].double(), x[..., r:].double()
    rot = torch.cat([-xr[..., r // 2 :], xr[..., : r // 2]], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor, r: int, base: float = 10000.0) -> torch.Tensor:
    """Cerebras / GPT-J style: adjacent pairs (2j, 2j + 1) of the first r dims."""
    inv = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = pos[:, None].double() * inv[None]
    xr, xp = x[..., :r].double(), x[..., r:].double()
    a, b = xr[..., 0::2], xr[..., 1::2]
    out = torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1).flatten(-2)
    return torch.cat([out, xp], -1)


@pytest.mark.parametrize(("heads", "d", "r"), [(4, 16, 16), (4, 16, 4), (2, 8, 6)])
def test_rope_permutation_preserves_attention_scores(heads: int, d: int, r: int) -> None:
    torch.manual_seed(0)
    hidden, T = 32, 7
    wq, wk = torch.randn(heads * d, hidden), torch.randn(heads * d, hidden)
    bq = torch.randn(heads * d)
    x, pos = torch.randn(T, hidden), torch.arange(T)

    def scores(wq_, bq_, wk_, rope):
        q = (x @ wq_.T + bq_).view(T, heads, d).transpose(0, 1)
        k = (x @ wk_.T).view(T, heads, d).transpose(0, 1)
        return rope(q, pos, r) @ rope(k, pos, r).transpose(-1, -2)

    hf = scores(wq, bq, wk, rope_rotate_half)
    cs_q = _to_cs("rope", [wq], head_dim=d, rotary_dim=r)
    cs_b = _to_cs("rope", [bq], head_dim=d, rotary_dim=r)
    cs_k = _to_cs("rope", [wk], head_dim=d, rotary_dim=r)
    cs = scores(cs_q, cs_b, cs_k, rope_interleaved)
    torch.testing.assert_close(cs, hf, rtol=1e-9, atol=1e-9)
    assert torch.equal(_to_hf("rope", [cs_q], head_dim=d, rotary_dim=r), wq)
    assert torch.equal(_to_hf("rope", [cs_b], head_dim=d, rotary_dim=r), bq)


def test_rope_reference_example() -> None:
    # d = r = 4: HF rows (0, 1, 2, 3) become CS rows (0, 2, 1, 3)
    x = torch.arange(4.0)
    assert rope_permute(x, 4, 4, to_cs=True).tolist() == [0.0, 2.0, 1.0, 3.0]
    # partial rotary: rows >= r of each head untouched
    y = torch.arange(16.0)
    assert rope_permute(y, 8, 4, to_cs=True).tolist() == [0, 2, 1, 3, 4, 5, 6, 7, 8, 10, 9, 11, 12, 13, 14, 15]


def test_rope_rejects_inconsistent_shapes() -> None:
    from ckptconv.core.errors import ConversionError

    with pytest.raises(ConversionError):
        rope_permute(torch.zeros(10, 4), 4, 4, to_cs=True)
    with pytest.raises(ConversionError):
        rope_permute(torch.zeros(8, 4), 4, 3, to_cs=True)


@pytest.mark.parametrize(("shape", "d", "r"), [((64, 8), 16, 16), ((64,), 16, 4), ((48, 3, 2), 8, 6), ((0, 4), 4, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("to_cs", [True, False])
def test_rope_on_raw_tensors_moves_the_bytes_the_torch_permutation_moves(
    shape: tuple[int, ...], d: int, r: int, dtype: torch.dtype, to_cs: bool
) -> None:
    from ckptconv.formats.base import RawTensor

    x = (torch.arange(math.prod(shape)) * 7 % 251).to(dtype).reshape(shape)
    raw = RawTensor(x.reshape(-1).view(torch.uint8).numpy().copy(), str(dtype)[6:], shape)
    out = rope_permute(raw, d, r, to_cs=to_cs)
    assert isinstance(out, RawTensor) and out.dtype == raw.dtype and out.shape == shape
    assert torch.equal(out.torch(), rope_permute(x, d, r, to_cs=to_cs))
    assert torch.equal(raw.torch(), x)  # the input is left as it was


def test_a_plan_of_copies_and_rotary_permutations_needs_no_meta_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from ckptconv.core.errors import ConversionError
    from ckptconv.engine.layouts import steps
    from ckptconv.engine.layouts.steps import Pre, make_step
    from ckptconv.formats.base import Entry

    entries = {"w": Entry("w", "tensor", "bfloat16", (64, 8)), "b": Entry("b", "array", "float32", (64,))}
    params = {"head_dim": 16, "rotary_dim": 4}
    with monkeypatch.context() as m:
        m.setattr(steps, "meta_tensor", None)  # calling it would fail
        fast = [make_step(f"o.{k}", [Pre((k,))], _rope_fn, params, 0, "rope", 1.0, entries) for k in entries]
        with pytest.raises(ConversionError):  # a shape the permutation cannot take is refused all the same
            make_step("o", [Pre(("w",))], _rope_fn, {"head_dim": 24, "rotary_dim": 4}, 0, "rope", 1.0, entries)
    for name in ("rope", "copy"):
        monkeypatch.setitem(TRANSFORMS, name, dataclasses.replace(TRANSFORMS[name], same_shape=None))
    probed = [make_step(f"o.{k}", [Pre((k,))], _rope_fn, params, 0, "rope", 1.0, entries) for k in entries]
    assert [s.out for s in fast] == [s.out for s in probed]
    assert all(s.transform is not None and s.transform.raw for s in fast)
    assert not any(s.transform is not None and s.transform.raw for s in probed)


def _rope_fn(values: list, params: dict, index: int):
    return TRANSFORMS["rope"].to_cs(values, params, index)


# --- fused projections --------------------------------------------------------------------------

FUSED = {
    # name: (params, rows of the fused weight, expected (q, k, v) row ranges of the fused weight)
    "gpt2": (dict(groups=1, unit=4, parts={"q": 4, "k": 4, "v": 4}, outputs=["q", "k", "v"], transpose=True), 48),
    "neox": (dict(groups=4, unit=4, parts={"q": 1, "k": 1, "v": 1}, outputs=["q", "k", "v"]), 48),
    "falcon-gqa": (dict(groups=2, unit=4, parts={"q": 2, "k": 1, "v": 1}, outputs=["q", "k", "v"]), 32),
    "codegen": (dict(groups=4, unit=4, parts={"q": 1, "v": 1, "k": 1}, outputs=["q", "k", "v"]), 48),
    "starcoder-mqa": (dict(groups=1, unit=4, parts={"q": 4, "k": 1, "v": 1}, outputs=["q", "k", "v"]), 24),
    "santacoder-kv": (dict(groups=1, unit=4, parts={"k": 1, "v": 1}, outputs=["k", "v"], transpose=True), 8),
}


@pytest.mark.parametrize("layout", list(FUSED))
def test_fused_split_merge_inverse(layout: str) -> None:
    params, rows = FUSED[layout]
    torch.manual_seed(1)
    w = torch.randn(rows, 16)
    if params.get("transpose"):
        w = w.t().contiguous()  # HF Conv1D stores [in, out]
    b = torch.randn(rows)
    for t in (w, b):
        parts = [_to_cs("fused", [t], i, **params) for i in range(len(params["outputs"]))]
        assert all(p.is_contiguous() for p in parts)
        assert torch.equal(_to_hf("fused", parts, **params), t)


def test_fused_layouts_match_the_reference_rows() -> None:
    w = torch.arange(48.0)[:, None].expand(48, 2).contiguous()  # row r holds r
    # GPT-NeoX: per head [q_h; k_h; v_h] blocks of d rows (H = 4, d = 4)
    q = _to_cs("fused", [w], 0, **FUSED["neox"][0])
    assert q[:, 0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 24, 25, 26, 27, 36, 37, 38, 39]
    # CodeGen: shard s, row j < h/4: q = s*3h/4 + j, v = s*3h/4 + h/4 + j, k = s*3h/4 + h/2 + j (h = 16)
    p = FUSED["codegen"][0]
    q, k, v = (_to_cs("fused", [w], i, **p)[:, 0].tolist() for i in range(3))
    assert q == [s * 12 + j for s in range(4) for j in range(4)]
    assert v == [s * 12 + 4 + j for s in range(4) for j in range(4)]
    assert k == [s * 12 + 8 + j for s in range(4) for j in range(4)]
    # Falcon GQA: per group g query heads, then one key, one value (G = 2, g = 2, d = 4)
    w32 = torch.arange(32.0)[:, None]
    p = FUSED["falcon-gqa"][0]
    q, k, v = (_to_cs("fused", [w32], i, **p)[:, 0].tolist() for i in range(3))
    assert q == [*range(0, 8), *range(16, 24)] and k == [*range(8, 12), *range(24, 28)]
    assert v == [*range(12, 16), *range(28, 32)]


def test_gpt2_conv1d_split_matches_hf_forward() -> None:
    """GPT-2 computes qkv = x @ c_attn.weight + bias and splits the last dim in three."""
    torch.manual_seed(2)
    h = 16
    w, b, x = torch.randn(h, 3 * h), torch.randn(3 * h), torch.randn(5, h)
    hf_q, hf_k, hf_v = (x @ w + b).split(h, dim=-1)
    p = dict(groups=1, unit=4, parts={"q": 4, "k": 4, "v": 4}, outputs=["q", "k", "v"], transpose=True)
    for i, want in enumerate((hf_q, hf_k, hf_v)):
        cs_w, cs_b = _to_cs("fused", [w], i, **p), _to_cs("fused", [b], i, **p)
        torch.testing.assert_close(x @ cs_w.T + cs_b, want)


def test_fused_rope_applies_to_q_and_k_only() -> None:
    w = torch.randn(24, 8)
    p = dict(
        groups=2,
        unit=4,
        parts={"q": 1, "k": 1, "v": 1},
        outputs=["q", "k", "v"],
        rope=["q", "k"],
        head_dim=4,
        rotary_dim=4,
    )
    q, k, v = (_to_cs("fused", [w], i, **p) for i in range(3))
    plain = {n: _to_cs("fused", [w], i, **{**p, "rope": []}) for i, n in enumerate("qkv")}
    assert torch.equal(q, rope_permute(plain["q"], 4, 4, to_cs=True))
    assert torch.equal(k, rope_permute(plain["k"], 4, 4, to_cs=True))
    assert torch.equal(v, plain["v"])
    assert torch.equal(_to_hf("fused", [q, k, v], **p), w)


def test_fused_refuses_wrong_row_count() -> None:
    from ckptconv.core.errors import ConversionError

    with pytest.raises(ConversionError, match="rows"):
        _to_cs(
            "fused", [torch.zeros(10, 4)], 0, groups=1, unit=4, parts={"q": 1, "k": 1, "v": 1}, outputs=["q", "k", "v"]
        )


# --- elementary, experts, generators ------------------------------------------------------------


def test_transpose_only_2d() -> None:
    w, b = torch.randn(3, 5), torch.randn(5)
    assert torch.equal(_to_cs("transpose", [w]), w.t()) and _to_cs("transpose", [w]).is_contiguous()
    assert _to_cs("transpose", [b]) is b


def test_experts_stack_on_dim_1() -> None:
    experts = [torch.randn(6, 4) for _ in range(3)]
    fused = _to_cs("stack_experts", experts)
    assert fused.shape == (6, 3, 4)
    for e in range(3):
        assert torch.equal(_to_hf("stack_experts", [fused], e), experts[e])


def test_norm_offset_in_float32_for_half_types() -> None:
    w = torch.tensor([0.5, -0.25], dtype=torch.bfloat16)
    up = _to_cs("add_one", [w])
    assert up.dtype == torch.bfloat16 and up.tolist() == [1.5, 0.75]
    assert torch.equal(_to_hf("add_one", [up]), w)


def test_alibi_slopes() -> None:
    assert alibi_slopes(4) == [0.25, 0.0625, 0.015625, 0.00390625]
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    # BLOOM rule for 6 heads: slopes(4) then every other slope of slopes(8)
    assert alibi_slopes(6) == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    # MPT rule for 12 heads: slopes(16), odd positions then even ones
    s16 = [2.0 ** (-8 * (i + 1) / 16) for i in range(16)]
    assert alibi_slopes(12, style="mpt") == (s16[1::2] + s16[0::2])[:12]
    t = _to_cs("alibi_slopes", [torch.zeros(1)], heads=4)
    assert t.dtype == torch.float32 and t.shape == (4, 1)


def test_generated_buffers() -> None:
    anchor = torch.zeros(3)
    mask = _to_hf("causal_mask", [anchor], size=4)
    assert mask.dtype == torch.uint8 and mask.shape == (1, 1, 4, 4) and mask[0, 0].tolist()[1] == [1, 1, 0, 0]
    mb = _to_hf("scalar", [anchor], value=-1e4)
    assert mb.dim() == 0 and mb.dtype == torch.float32 and float(mb) == -1e4
    inv = _to_hf("inv_freq", [anchor], rotary_dim=4, base=10000)
    assert inv.dtype == torch.float32 and inv.tolist() == pytest.approx([1.0, 0.01])
    pid = _to_hf("position_ids", [anchor], size=5)
    assert pid.dtype == torch.int64 and pid.tolist() == [[0, 1, 2, 3, 4]]
    z = _to_hf("zeros", [torch.zeros(2, dtype=torch.float16)], shape=[1, 3])
    assert z.dtype == torch.float16 and z.shape == (1, 3)


def test_headless_lm_head() -> None:
    emb = torch.randn(32, 8)
    assert torch.equal(_to_cs("lm_head", [emb], tie=True), emb)
    a, b = _to_cs("lm_head", [emb], tie=False), _to_cs("lm_head", [emb], tie=False)
    assert torch.equal(a, b) and abs(float(a.std()) - 0.02) < 0.01  # N(0, 0.02) from a fixed seed
    meta = _to_cs("lm_head", [torch.empty(32, 8, device="meta")], tie=False)
    assert meta.device.type == "meta" and meta.shape == (32, 8)


def test_scale_rounds_once_for_bf16() -> None:
    w = torch.randn(10).to(torch.bfloat16)
    out = _to_hf("scale", [w], factor=1 / math.sqrt(3))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (w.float() * (1 / math.sqrt(3))).to(torch.bfloat16))


def test_lora_fold() -> None:
    torch.manual_seed(3)
    w, a, b = torch.randn(6, 4), torch.randn(2, 4), torch.randn(6, 2)
    torch.testing.assert_close(lora_fold(w, a, b, 0.5), w + 0.5 * (b @ a))
    # embedding: W [num, dim], A [r, num], B [dim, r]
    e, ea, eb = torch.randn(10, 4), torch.randn(2, 10), torch.randn(4, 2)
    torch.testing.assert_close(lora_fold(e, ea, eb, 2.0, embedding=True), e + 2.0 * (eb @ ea).T)


def test_every_transform_runs_on_meta() -> None:
    """The planner learns output shapes from meta tensors: every transform must accept them."""
    meta = torch.empty(12, 8, device="meta")
    p = dict(
        groups=1,
        unit=4,
        parts={"q": 1, "k": 1, "v": 1},
        outputs=["q", "k", "v"],
        head_dim=4,
        rotary_dim=4,
        size=4,
        value=1.0,
        base=10000,
        heads=4,
        shape=[2, 2],
        factor=2.0,
        tie=False,
    )
    for name, t in TRANSFORMS.items():
        args = [meta, meta, meta] if name in ("stack_experts",) else [meta]
        for fn in (t.to_cs, t.to_hf):
            if name == "fused" and fn is t.to_hf:
                args = [torch.empty(4, 8, device="meta")] * 3
            out = fn(args, p, 0)
            assert out.device.type == "meta", name
