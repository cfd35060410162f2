"""Sparsity masks across release 2.2 (model-conversions §1.4): ``optimizer.sparsity.state[p].mask``
-> ``model["<p>_mask"]`` plus a top-level ``sparsity`` entry, planned from metadata only."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.core.errors import SparsityStateError
from ckptconv.engine.layouts.api import convert_config_dict, convert_model, plan_model
from ckptconv.engine.layouts.models import build_plan
from ckptconv.engine.layouts.planner import Request
from ckptconv.engine.simulator.checkpoint_io import open_checkpoint, read_checkpoint, write_checkpoint

LAYER = "transformer_decoder.layers.0."
FFN = f"{LAYER}ffn.ffn.0.linear_layer.weight"
QPROJ = f"{LAYER}self_attn.proj_q_dense_layer.weight"
POS = "embedding_layer.position_embeddings.weight"  # renamed by 2.0 -> 2.1 (".embed.weight")

CONFIG_2_1: dict[str, Any] = {
    "model": {
        "vocab_size": 32,
        "hidden_size": 8,
        "num_heads": 2,
        "num_hidden_layers": 1,
        "max_position_embeddings": 16,
        "filter_size": 16,
        "nonlinearity": "gelu",
        "norm_type": "layernorm",
        "fp16_type": "bfloat16",
    },
    "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-4},
    "sparsity": {"type": "gmp", "sparsity_schedule": [[0, 0.1], [6, 0.5]], "schedule": 2},
    "runconfig": {"max_steps": 10},
    "train_input": {"batch_size": 2},
}
CONFIG_2_0 = copy.deepcopy(CONFIG_2_1)
CONFIG_2_0["model"].pop("fp16_type")
CONFIG_2_0["model"]["use_bfloat16"] = True


def _model(inner: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        f"{inner}embedding_layer.word_embeddings.weight": torch.randn(32, 8, generator=g),
        f"{inner}{POS}": torch.randn(16, 8, generator=g),
        f"{inner}{FFN}": torch.randn(16, 8, generator=g),
        f"{inner}{FFN[:-6]}bias": torch.randn(16, generator=g),
        f"{inner}{QPROJ}": torch.randn(8, 8, generator=g).to(torch.bfloat16),
    }


def old_state(inner: str = "model.", *, dynamic: bool = True, masked: tuple[str, ...] = (FFN, QPROJ)) -> dict:
    """A 2.0/2.1 trainer checkpoint whose optimizer is wrapped by a sparsity optimizer."""
    g = torch.Generator().manual_seed(0)
    model = _model(inner, g)
    names = tuple(f"{inner}{p}" for p in masked)
    # Masks are bool in cstorch; one is uint8 here to show that the dtype is kept whatever it is.
    masks = {n: torch.rand(model[n].shape, generator=g) > 0.5 for n in names}
    if len(names) > 1:
        masks[names[1]] = masks[names[1]].to(torch.uint8)
    step = torch.tensor(7, dtype=torch.int64)
    group: dict[str, Any] = {"param_names": names, "name": "group_0", "init_method": "random"}
    group["sparsity"] = {"step": step} if dynamic else 0.5
    sparsity: dict[str, Any] = {"state": {n: {"mask": m} for n, m in masks.items()}, "param_groups": [group]}
    if dynamic:
        sparsity["step"] = step  # the same tensor: cstorch stores the second occurrence as a link
    return {
        "model": model,
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(4, generator=g), "step": torch.tensor(7.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
            "sparsity": sparsity,
        },
        # A scheduler tensor shared with the sparsity optimizer: a link to a key that moves away.
        "lr_scheduler": {"last_epoch": 7, "_step_count": step if dynamic else 8},
        "global_step": 7,
        "__metadata__": [{"version": "2.1.0", "model_name": "GPT2Model", "params": {}}],
    }


def write(path: Path, state: dict, version: str = "2.1.0") -> str:
    write_checkpoint(str(path), state, cstorch_version=version)
    return str(path)


def read_all(uri: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(flat key -> tensor or value, nested checkpoint, top-level labels) of a CS checkpoint."""
    src = open_checkpoint(uri)
    try:
        flat = {
            e.key: (src.read(e.key) if e.kind in ("tensor", "link") else e.value)
            for e in src.entries()
            if e.kind in ("tensor", "value", "link")
        }
        nested = read_checkpoint(src)
        top = [str(k) for k in src.spec.child_labels()]
    finally:
        src.close()
    return flat, nested, top


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))  # bits, not values
        )
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("inner", ["model.", ""])
@pytest.mark.parametrize("dynamic", [True, False])
def test_upgrade_moves_masks_into_the_model(tmp_path: Path, inner: str, dynamic: bool) -> None:
    state = old_state(inner, dynamic=dynamic)
    src = write(tmp_path / "checkpoint_7.mdl", state)
    r = convert_model(src, str(tmp_path / "out"), model="gpt2", src_fmt="cs-2.1", tgt_fmt="cs-2.9", config=CONFIG_2_1)
    assert any("2 sparsity masks moved" in w for w in r.warnings)
    before, _, _ = read_all(src)
    after, nested, top = read_all(r.target)

    # The masks sit beside their parameters, bit for bit and in their own dtype.
    masks = state["optimizer"]["sparsity"]["state"]
    for p, s in masks.items():
        assert same(after[f"model.{p}_mask"], s["mask"]), p
    assert after[f"model.{inner}{QPROJ}_mask"].dtype == torch.uint8
    assert nested["model"][f"{inner}{FFN}_mask"].dtype == torch.bool

    # The sparsity optimizer is gone; its step and schedule state are the top-level `sparsity`.
    assert list(nested["optimizer"]) == ["state", "param_groups"]
    assert not [k for k in after if k.startswith("optimizer.sparsity")]
    assert top == ["model", "optimizer", "lr_scheduler", "global_step", "sparsity", "__metadata__"]
    if dynamic:
        step = torch.tensor(7, dtype=torch.int64)
        assert set(nested["sparsity"]) == {"step", "sparsity"}
        assert same(nested["sparsity"]["step"], step)
        assert list(nested["sparsity"]["sparsity"]) == list(masks)
        for p in masks:
            assert same(nested["sparsity"]["sparsity"][p]["index"], step)
    else:
        assert nested["sparsity"] == {}  # static sparsity: an empty state, as the Model Zoo writes it

    # Everything else is unchanged (values and bits); only the release record is new.
    kept = {k: v for k, v in before.items() if not k.startswith(("optimizer.sparsity.", "__metadata__"))}
    for k, v in kept.items():
        assert same(after[k], v), k
    new = set(after) - set(kept) - {k for k in after if k.startswith("__metadata__.")}
    assert new == {f"model.{p}_mask" for p in masks} | {k for k in after if k.startswith("sparsity.")}
    assert nested["__metadata__"][0] == state["__metadata__"][0]
    assert nested["__metadata__"][1]["version"] == "2.9.0"


def test_the_plan_reads_no_tensor_data(tmp_path: Path) -> None:
    src = open_checkpoint(write(tmp_path / "c.mdl", old_state()))

    def refuse(key: str) -> Any:
        raise AssertionError(f"planning read {key}")

    try:
        src.read = refuse  # type: ignore[method-assign]
        plan, _ = build_plan(src, CONFIG_2_1, Request("gpt2", "cs-2.1", "cs-2.9"))
    finally:
        src.close()
    mask = next(s for s in plan.steps if s.out.key == f"model.model.{FFN}_mask")
    assert mask.inputs == (f"optimizer.sparsity.state.model.{FFN}.mask",)
    assert mask.transform is None and mask.out.dtype == "bool" and mask.out.shape == (16, 8)
    assert "optimizer.sparsity.param_groups.0.name" in plan.dropped
    # The scheduler entry that linked into the moved state is written as a copy of its value.
    sched = next(s for s in plan.steps if s.out.key == "lr_scheduler._step_count")
    assert sched.out.kind == "tensor" and sched.inputs


def test_renamed_parameters_keep_their_masks(tmp_path: Path) -> None:
    """From 2.0 the path renames the position embedding (2.0 -> 2.1); its mask and schedule follow."""
    state = old_state(masked=(POS, FFN))
    state["__metadata__"][0]["version"] = "2.0.0"
    src = write(tmp_path / "c.mdl", state, "2.0.0")
    r = convert_model(src, str(tmp_path / "out"), model="gpt2", src_fmt="cs-2.0", tgt_fmt="cs-2.9", config=CONFIG_2_0)
    after, nested, _ = read_all(r.target)
    new_pos = "model.embedding_layer.position_embeddings.embed.weight"
    assert same(after[f"model.{new_pos}_mask"], state["optimizer"]["sparsity"]["state"][f"model.{POS}"]["mask"])
    assert list(nested["sparsity"]["sparsity"]) == [new_pos, f"model.{FFN}"]
    assert f"model.model.{POS}_mask" not in after


def test_checkpoints_without_sparsity_state_are_unaffected(tmp_path: Path) -> None:
    state = old_state()
    del state["optimizer"]["sparsity"]
    state["lr_scheduler"]["_step_count"] = 8
    src = write(tmp_path / "dense.mdl", state)
    plan = plan_model(src, model="gpt2", src_fmt="cs-2.1", tgt_fmt="cs-2.9", config=CONFIG_2_1)
    assert not any("sparsity" in w for w in plan.warnings) and not plan.dropped
    assert not [s for s in plan.steps if s.out.key.endswith("_mask") or s.out.key.startswith("sparsity")]
    r = convert_model(src, str(tmp_path / "out"), model="gpt2", src_fmt="cs-2.1", tgt_fmt="cs-2.9", config=CONFIG_2_1)
    before, _, top_before = read_all(src)
    after, _, top = read_all(r.target)
    assert top == top_before
    assert set(after) - set(before) == {k for k in after if k.startswith("__metadata__.1.")}
    for k, v in before.items():
        assert same(after[k], v), k


def test_targets_before_2_2_keep_the_sparsity_optimizer(tmp_path: Path) -> None:
    """2.0 and 2.1 load masks from optimizer.sparsity: a 2.0 -> 2.1 upgrade leaves it where it is."""
    state = old_state()
    src = write(tmp_path / "c.mdl", state, "2.0.0")
    plan = plan_model(src, model="gpt2", src_fmt="cs-2.0", tgt_fmt="cs-2.1", config=CONFIG_2_0)
    keys = [s.out.key for s in plan.steps]
    assert f"optimizer.sparsity.state.model.{FFN}.mask" in keys
    assert not [k for k in keys if k.endswith("_mask") or k.startswith("sparsity.")]


def test_downgrade_below_2_2_warns(tmp_path: Path) -> None:
    up = str(tmp_path / "up")
    src = write(tmp_path / "c.mdl", old_state())
    r = convert_model(src, up, model="gpt2", src_fmt="cs-2.1", tgt_fmt="cs-2.9", config=CONFIG_2_1)
    cfg_2_9 = convert_config_dict(CONFIG_2_1, model="gpt2", src_fmt="cs-2.1", tgt_fmt="cs-2.9").target
    plan = plan_model(r.target, model="gpt2", src_fmt="cs-2.9", tgt_fmt="cs-2.1", config=cfg_2_9)
    assert any("no conversion back" in w and "2 <parameter>_mask" in w for w in plan.warnings)
    keys = [s.out.key for s in plan.steps]
    assert f"model.model.{FFN}_mask" in keys and "sparsity.step" in keys  # copied as they are


def _refused(tmp_path: Path, state: dict) -> SparsityStateError:
    src = write(tmp_path / "bad.mdl", state)
    with pytest.raises(SparsityStateError) as err:
        plan_model(src, model="gpt2", src_fmt="cs-2.1", tgt_fmt="cs-2.9", config=CONFIG_2_1)
    assert err.value.code == "sparsity_state_error"
    assert err.value.hint
    return err.value


def test_mask_of_a_parameter_not_in_the_model_is_refused(tmp_path: Path) -> None:
    state = old_state()
    sp = state["optimizer"]["sparsity"]["state"]
    sp["model.transformer_decoder.layers.9.ffn.ffn.0.linear_layer.weight"] = {"mask": torch.ones(2, 2, dtype=bool)}
    err = _refused(tmp_path, state)
    assert "layers.9" in err.message and "not a parameter of the model" in err.message
    assert "remove optimizer.sparsity" in (err.hint or "")


def test_mask_named_without_the_model_prefix_is_refused_with_the_near_name(tmp_path: Path) -> None:
    state = old_state()
    sp = state["optimizer"]["sparsity"]["state"]
    sp[FFN] = sp.pop(f"model.{FFN}")
    err = _refused(tmp_path, state)
    assert f"the model has 'model.{FFN}'" in err.message


def test_malformed_masks_are_refused(tmp_path: Path) -> None:
    state = old_state()
    state["optimizer"]["sparsity"]["state"][f"model.{FFN}"]["mask"] = torch.ones(8, 16, dtype=torch.bool)
    assert "has shape [8, 16] but the parameter has [16, 8]" in _refused(tmp_path / "a", state).message

    state = old_state()
    state["optimizer"]["sparsity"]["state"][f"model.{FFN}"]["mask"] = None
    assert "is None, not a tensor" in _refused(tmp_path / "b", state).message

    state = old_state()
    state["sparsity"] = {"step": torch.tensor(1)}
    assert "both optimizer.sparsity" in _refused(tmp_path / "c", state).message

    state = old_state()
    state["model"][f"model.{FFN}_mask"] = torch.ones(16, 8, dtype=torch.bool)
    assert "already has" in _refused(tmp_path / "d", state).message


def test_export_applies_2_2_masks(tmp_path: Path) -> None:
    """A 2.2+ sparse checkpoint keeps ``<p>_mask`` buffers; towards Hugging Face each mask is applied
    to its weight (before the rotary permutation of q/k), so the HF model computes with the pruned
    weights the Cerebras model used."""
    transformers = pytest.importorskip("transformers")
    from test_layouts_families import _randomize, load_dir

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    hf_model = _randomize(transformers.LlamaForCausalLM(cfg), seed=4)
    hf_model.save_pretrained(tmp_path / "hf")
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    cfg_path = next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))
    src = open_checkpoint(r.target)
    try:
        state = read_checkpoint(src)
    finally:
        src.close()
    g = torch.Generator().manual_seed(1)
    pruned = {"q_proj": "self_attn.proj_q_dense_layer.weight", "up_proj": "ffn.ffn.0.linear_layer.weight"}
    for cs_name in pruned.values():
        w = state["model"][f"transformer_decoder.layers.0.{cs_name}"]
        state["model"][f"transformer_decoder.layers.0.{cs_name}_mask"] = torch.rand(w.shape, generator=g) > 0.5
    write_checkpoint(str(tmp_path / "sparse.mdl"), state, cstorch_version="2.9.0")

    back = convert_model(
        str(tmp_path / "sparse.mdl"),
        str(tmp_path / "back"),
        model="llama",
        src_fmt="cs-2.9",
        tgt_fmt="hf",
        config=cfg_path,
    )
    assert any("2 sparsity masks were applied" in w for w in back.warnings)
    got = load_dir(back.target)
    assert not [k for k in got if k.endswith("_mask")]
    # Prune the original HF model by the same masks (mapped to HF rows: q is rotary-permuted).
    from ckptconv.engine.layouts.transforms import rope_permute

    expected = {k: v.clone() for k, v in hf_model.state_dict().items()}
    for hf_name, cs_name in pruned.items():
        mask = state["model"][f"transformer_decoder.layers.0.{cs_name}_mask"]
        if hf_name == "q_proj":
            mask = rope_permute(mask, 8, 8, to_cs=False)
        key = f"model.layers.0.{'self_attn' if hf_name == 'q_proj' else 'mlp'}.{hf_name}.weight"
        expected[key] = expected[key].masked_fill(~mask, 0)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    pruned_model = _randomize(transformers.LlamaForCausalLM(cfg), seed=0)
    pruned_model.load_state_dict(expected)
    loaded = transformers.LlamaForCausalLM.from_pretrained(back.target).eval()
    ids = torch.randint(0, 64, (2, 7), generator=g)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, pruned_model.eval()(ids).logits)
