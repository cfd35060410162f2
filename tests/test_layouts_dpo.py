"""DPO checkpoints: hf <-> cs-X.Y-dpo and cs-2.1-no-dpo <-> cs-2.1-dpo (families/dpo.yaml and
ckptconv.engine.layouts.families.dpo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ckptconv.core.errors import ConfigConversionError, NoConversionPath
from ckptconv.engine.layouts.api import convert_config_dict, convert_model, plan_model
from ckptconv.engine.layouts.registry import describe_model, list_models

transformers = pytest.importorskip("transformers")

from test_layouts_families import CASES, V, gpt2_keys, llama_keys, load_dir  # noqa: E402


def _tiny(kind: str, path: Path) -> Any:
    """The family test's tiny model of ``kind``, saved to ``path``."""
    torch.manual_seed(0)
    model = next(c for c in CASES if c.model == kind).build().eval()
    model.save_pretrained(path)
    return model


def load_cs(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Cerebras checkpoint, links followed."""
    from ckptconv.formats.detect import open_source

    src = open_source(path)
    try:
        return {e.key: src.read(e.key) for e in src.entries() if e.kind in ("tensor", "array", "link")}
    finally:
        src.close()


def _links(mdl: str) -> dict[str, str]:
    """Every LinkedObject entry of the file (cs-checkpoint-format 1.9): key -> the key it aliases."""
    from ckptconv.formats.detect import open_source

    src = open_source(mdl)
    try:
        return {e.key: str(e.target) for e in src.entries() if e.kind == "link"}
    finally:
        src.close()


@pytest.mark.parametrize(("kind", "keys"), [("llama", llama_keys), ("gpt2", gpt2_keys)])
def test_hf_to_dpo_and_back(tmp_path: Path, kind: str, keys: Any) -> None:
    model = _tiny(kind, tmp_path / "hf")
    original = load_dir(str(tmp_path / "hf"))

    plan = plan_model(str(tmp_path / "hf"), model="dpo", src_fmt="hf", tgt_fmt="cs-2.9-dpo")
    assert plan.extras["base_model"] == kind and not plan.unmatched
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="dpo", src_fmt="hf", tgt_fmt="cs-2.9-dpo")
    assert r.target.endswith("model_to_cs-2.9-dpo.mdl")
    cfg_path = next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))
    assert cfg_path.endswith("config_to_cs-2.9-dpo.yaml")
    cfg = yaml.safe_load(Path(cfg_path).read_text())
    assert cfg["model"]["model_name"] == kind and cfg["model"]["dpo"] == {"beta": 0.1, "reference_free": False}

    cs = load_cs(r.target)
    inner = set(keys())
    policy = {f"model.policy_model.model.{k}" for k in inner}
    ref = {f"model.ref_model.model.{k}" for k in inner}
    assert set(cs) == policy | ref
    for k in inner:
        assert tuple(cs[f"model.policy_model.model.{k}"].shape) == keys()[k]
        assert torch.equal(cs[f"model.ref_model.model.{k}"], cs[f"model.policy_model.model.{k}"])
    # The reference model is stored once: every reference key is a link into the policy.
    links = _links(r.target)
    assert {f"model.ref_model.model.{k}" for k in inner} <= set(links)
    assert all(t.startswith("model.policy_model.model.") for k, t in links.items() if "ref_model" in k)

    back = convert_model(
        r.target, str(tmp_path / "back"), model="dpo", src_fmt="cs-2.9-dpo", tgt_fmt="hf", config=cfg_path
    )
    assert any("reference model" in w for w in back.warnings)
    assert back.extras["model_conversion"]["base_model"] == kind
    got = load_dir(back.target)
    for k, v in original.items():
        assert torch.equal(got[k], v), k
    from ckptconv.engine.simulator.verify import verify

    assert verify(str(tmp_path / "hf"), r.target, cfg_path, "dpo")["verdict"] == "skipped"
    loaded = type(model).from_pretrained(back.target).eval()
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_no_dpo_to_dpo_and_back_on_release_2_1(tmp_path: Path) -> None:
    _tiny("llama", tmp_path / "hf")
    plain = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="llama", src_fmt="hf", tgt_fmt="cs-2.1")
    cfg_path = Path(next(o.uri for o in plain.outputs if o.uri.endswith(".yaml")))
    doc = yaml.safe_load(cfg_path.read_text())
    with pytest.raises(ConfigConversionError, match="model_name"):
        plan_model(plain.target, model="dpo", src_fmt="cs-2.1-no-dpo", tgt_fmt="cs-2.1-dpo", config=doc)
    doc["model"]["model_name"] = "llama"
    cfg_path.write_text(yaml.safe_dump(doc))

    up = convert_model(
        plain.target,
        str(tmp_path / "dpo"),
        model="dpo",
        src_fmt="cs-2.1-no-dpo",
        tgt_fmt="cs-2.1-dpo",
        config=str(cfg_path),
    )
    base = load_cs(plain.target)
    wrapped = load_cs(up.target)
    assert len(wrapped) == 2 * len([k for k in base if k.startswith("model.")])
    for k, v in base.items():
        inner = k.removeprefix("model.")
        assert torch.equal(wrapped[f"model.policy_model.model.{inner}"], v)
        assert torch.equal(wrapped[f"model.ref_model.model.{inner}"], v)
    up_cfg = next(o.uri for o in up.outputs if o.uri.endswith(".yaml"))
    assert yaml.safe_load(Path(up_cfg).read_text())["model"]["dpo"] == {"beta": 0.1, "reference_free": False}

    down = convert_model(
        up.target, str(tmp_path / "plain"), model="dpo", src_fmt="cs-2.1-dpo", tgt_fmt="cs-2.1-no-dpo", config=up_cfg
    )
    again = load_cs(down.target)
    assert set(again) == set(base)
    for k, v in base.items():
        assert torch.equal(again[k], v)
    down_cfg = yaml.safe_load(Path(next(o.uri for o in down.outputs if o.uri.endswith(".yaml"))).read_text())
    assert "dpo" not in down_cfg["model"] and down_cfg["model"]["model_name"] == "llama"


def test_dpo_refusals_and_listing(tmp_path: Path) -> None:
    with pytest.raises(NoConversionPath, match=r"cs-2\.1-no-dpo"):
        convert_config_dict({"model_type": "llama"}, model="dpo", src_fmt="hf", tgt_fmt="cs-2.9")
    with pytest.raises(ConfigConversionError, match="does not train"):
        convert_config_dict({"model_type": "t5"}, model="dpo", src_fmt="hf", tgt_fmt="cs-2.9-dpo")
    with pytest.raises(ConfigConversionError, match=r"model\.dpo"):
        convert_config_dict({"model": {"model_name": "llama"}}, model="dpo", src_fmt="cs-2.9-dpo", tgt_fmt="hf")
    entry = next(m for m in list_models() if m["name"] == "dpo")
    assert entry["supported"] and "cs-2.9-dpo" in entry["formats"] and "cs-2.1-no-dpo" in entry["formats"]
    assert describe_model("dpo")["key_rules"]

    # a plain (non-DPO) checkpoint named as a DPO source is refused by name
    _tiny("gpt2", tmp_path / "hf")
    plain = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="gpt2", src_fmt="hf", tgt_fmt="cs-2.9")
    doc = yaml.safe_load(Path(next(o.uri for o in plain.outputs if o.uri.endswith(".yaml"))).read_text())
    doc["model"].update(model_name="gpt2", dpo={"beta": 0.1})
    with pytest.raises(ConfigConversionError, match="not a DPO checkpoint"):
        plan_model(plain.target, model="dpo", src_fmt="cs-2.9-dpo", tgt_fmt="hf", config=doc)
