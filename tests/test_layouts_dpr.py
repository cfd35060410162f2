"""DPR: two Hugging Face encoder directories <-> one Cerebras checkpoint (families/dpr.yaml and
ckptconv.engine.layouts.families.dpr)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ckptconv.core.errors import CkptconvError, ConfigConversionError, NoConversionPath
from ckptconv.engine.layouts.api import convert_model, plan_model

transformers = pytest.importorskip("transformers")

from test_layouts_dpo import load_cs  # noqa: E402
from test_layouts_families import _randomize, load_dir  # noqa: E402

V, H, L, NH, P = 128, 32, 2, 4, 64
ENCODER_KEYS = {
    "embedding_layer.word_embeddings.weight": (V, H),
    "embedding_layer.segment_embeddings.weight": (2, H),
    "embedding_layer.position_embeddings.embed.weight": (P, H),
    "embed_ln_f.weight": (H,),
    "embed_ln_f.bias": (H,),
}
for _i in range(L):
    for _name, _shape in {
        "self_attn.proj_q_dense_layer": (H, H),
        "self_attn.proj_k_dense_layer": (H, H),
        "self_attn.proj_v_dense_layer": (H, H),
        "self_attn.proj_output_dense_layer": (H, H),
        "ffn.ffn.0.linear_layer": (2 * H, H),
        "ffn.ffn.1.linear_layer": (H, 2 * H),
    }.items():
        ENCODER_KEYS[f"transformer_encoder.layers.{_i}.{_name}.weight"] = _shape
        ENCODER_KEYS[f"transformer_encoder.layers.{_i}.{_name}.bias"] = (_shape[0],)
    for _norm in ("norm1", "norm2"):
        for _wb in ("weight", "bias"):
            ENCODER_KEYS[f"transformer_encoder.layers.{_i}.{_norm}.{_wb}"] = (H,)


def _dpr(root: Path, **overrides: Any) -> tuple[Any, Any]:
    cfg = transformers.DPRConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=NH,
        intermediate_size=2 * H,
        max_position_embeddings=P,
        **overrides,
    )
    torch.manual_seed(0)
    q = _randomize(transformers.DPRQuestionEncoder(cfg), seed=1)
    c = _randomize(transformers.DPRContextEncoder(cfg), seed=2)
    q.save_pretrained(root / "q_encoder")
    c.save_pretrained(root / "ctx_encoder")
    return q, c


def test_hf_to_cs_and_back(tmp_path: Path) -> None:
    q, c = _dpr(tmp_path / "hf")
    original = {**load_dir(str(tmp_path / "hf" / "q_encoder")), **load_dir(str(tmp_path / "hf" / "ctx_encoder"))}

    plan = plan_model(str(tmp_path / "hf"), model="dpr", src_fmt="hf", tgt_fmt="cs-2.9")
    assert not plan.unmatched and len(plan.steps) == 2 * len(ENCODER_KEYS)
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="dpr", src_fmt="hf", tgt_fmt="cs-2.9")
    assert r.target.endswith("/cs/pytorch_model_to_cs-2.9.mdl")  # the Model Zoo's name for a packed checkpoint
    cs = load_cs(r.target)
    want = {f"model.{enc}.{k}": s for enc in ("question_encoder", "ctx_encoder") for k, s in ENCODER_KEYS.items()}
    assert set(cs) == set(want), (sorted(set(cs) - set(want)), sorted(set(want) - set(cs)))
    for k, shape in want.items():
        assert tuple(cs[k].shape) == shape, k
    assert not [w for w in r.warnings if "cls." in w or "mlm" in w]  # the BERT heads are not DPR's
    cfg_path = next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))
    model = yaml.safe_load(Path(cfg_path).read_text())["model"]
    assert model["pooler_type"] == "cls" and model["use_biencoder"] is True
    for enc in ("q_encoder", "ctx_encoder"):
        assert model[enc]["hidden_size"] == H and model[enc]["add_pooling_layer"] is False and "name" not in model[enc]

    back = convert_model(r.target, str(tmp_path / "back"), model="dpr", src_fmt="cs-2.9", tgt_fmt="hf", config=cfg_path)
    out = Path(back.target)
    assert sorted(p.name for p in (out / "q_encoder").iterdir()) == [
        "config.json",
        "pytorch_model-00001-of-00001.bin",
        "pytorch_model.bin.index.json",
    ]
    got = {**load_dir(str(out / "q_encoder")), **load_dir(str(out / "ctx_encoder"))}
    for k, v in original.items():
        assert torch.equal(got[k], v), k
    assert set(got) - set(original) == {
        "question_encoder.bert_model.embeddings.position_ids",
        "ctx_encoder.bert_model.embeddings.position_ids",
    }
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    for cls, before, sub in (
        (transformers.DPRQuestionEncoder, q, "q_encoder"),
        (transformers.DPRContextEncoder, c, "ctx_encoder"),
    ):
        loaded = cls.from_pretrained(out / sub).eval()
        assert loaded.config.architectures == [cls.__name__]
        with torch.no_grad():
            assert torch.equal(before(ids).pooler_output, loaded(ids).pooler_output)


def test_a_failure_after_one_encoder_is_staged_publishes_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The two encoders are staged, verified and published together: the second one's writer
    # failing once the first one's files are complete leaves no directory of either.
    from ckptconv.core.errors import StorageError
    from ckptconv.formats.components import ComponentSink

    _dpr(tmp_path / "hf")
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="dpr", src_fmt="hf", tgt_fmt="cs-2.9")
    cfg_path = next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))
    committed: list[str] = []

    def commit_then_fail(self: ComponentSink) -> list:
        names = list(self.sinks)
        self.sinks[names[0]].commit()
        committed.append(names[0])
        raise StorageError(f"{names[1]}: the disk failed")  # as the second encoder's files close

    monkeypatch.setattr(ComponentSink, "_commit", commit_then_fail)
    back = tmp_path / "back"
    with pytest.raises(StorageError, match="the disk failed"):
        convert_model(r.target, str(back), model="dpr", src_fmt="cs-2.9", tgt_fmt="hf", config=cfg_path)
    assert committed == ["q_encoder"]
    assert not back.exists() or not any(p.is_file() for p in back.rglob("*")), sorted(back.rglob("*"))
    assert not list(tmp_path.rglob(".ckptconv-staging"))  # nothing staged is left either


def test_release_2_2_settings_and_refusals(tmp_path: Path) -> None:
    _dpr(tmp_path / "hf")
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="dpr", src_fmt="hf", tgt_fmt="cs-2.2")
    model = yaml.safe_load(Path(next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))).read_text())["model"]
    assert model["scale_similarity"] is False and "pooler_type" not in model
    with pytest.raises(NoConversionPath, match=r"cs-2\.2"):
        plan_model(str(tmp_path / "hf"), model="dpr", src_fmt="hf", tgt_fmt="cs-2.1")

    _dpr(tmp_path / "proj", projection_dim=16)
    with pytest.raises(ConfigConversionError, match="projection"):
        plan_model(str(tmp_path / "proj"), model="dpr", src_fmt="hf", tgt_fmt="cs-2.9")

    (tmp_path / "half").mkdir()
    _dpr(tmp_path / "tmp_half")
    (tmp_path / "tmp_half" / "q_encoder").rename(tmp_path / "half" / "q_encoder")
    with pytest.raises(CkptconvError, match="ctx_encoder"):
        plan_model(str(tmp_path / "half"), model="dpr", src_fmt="hf", tgt_fmt="cs-2.9")

    with pytest.raises(ConfigConversionError, match="not a DPR config"):
        plan_model(r.target, model="dpr", src_fmt="cs-2.2", tgt_fmt="hf", config={"model": {"hidden_size": H}})


def test_dry_run_names_every_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ckptconv.cli import main

    _dpr(tmp_path / "hf")
    argv = ["convert-model", str(tmp_path / "hf"), "--model", "dpr", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9"]
    assert main([*argv, "--dry-run"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == 2 * len(ENCODER_KEYS) and not doc.get("unmatched")
    assert doc["entries"][0]["recipe"].startswith("copy(question_encoder.bert_model.")


def test_job_options_and_listing_take_dpr() -> None:
    from ckptconv.engine.layouts.registry import describe_model, list_models
    from ckptconv.engine.simulator.verify import verify
    from ckptconv.jobs.kinds import ConvertModelOptions

    ConvertModelOptions(model="dpr", src_fmt="hf", tgt_fmt="cs-2.9")
    entry = next(m for m in list_models() if m["name"] == "dpr")
    assert entry["supported"] and entry["formats"][0] == "hf" and entry["formats"][1] == "cs-2.2"
    assert any("question_encoder" in r for r in describe_model("dpr")["key_rules"])
    assert verify("/nowhere", "/nowhere.mdl", {}, "dpr")["verdict"] == "skipped"
