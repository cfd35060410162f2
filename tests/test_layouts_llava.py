"""LLaVA (CLIP tower + projector + Llama, two HF directories <-> one CS checkpoint) and the
CLIP-ViT table it uses (families/llava.yaml with ckptconv.engine.layouts.families.llava,
families/clip_vit.yaml).

The reference model is transformers' own ``LlavaForConditionalGeneration``: its weights are laid
out as the original LLaVA release does (``image_model/`` + ``text_model/`` with
``model.mm_projector.{0,2}``), converted to Cerebras and back, and reassembled into a transformers
model whose logits must equal the original's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ckptconv.core.errors import ConfigConversionError, ConversionError, NoConversionPath, UnmatchedKeys
from ckptconv.engine.layouts.api import convert_config_dict, convert_model, plan_model

transformers = pytest.importorskip("transformers")

from test_layouts_dpo import load_cs  # noqa: E402
from test_layouts_families import _randomize, load_dir  # noqa: E402

# Vision tower: 32 px images in 8 px patches (16 patches + the class token); language model with GQA.
VH, VF, VL, VHEADS, IMG, PATCH, PROJ = 32, 64, 2, 4, 32, 8, 16
TV, TH, TF, TL, THEADS, TKV, TP = 128, 48, 96, 2, 4, 2, 64
IMAGE_TOKEN = TV - 1


def vision_config(**overrides: Any) -> Any:
    kw = dict(
        hidden_size=VH,
        intermediate_size=VF,
        num_hidden_layers=VL,
        num_attention_heads=VHEADS,
        image_size=IMG,
        patch_size=PATCH,
        projection_dim=PROJ,
    )
    return transformers.CLIPVisionConfig(**{**kw, **overrides})


def llava_model(seed: int = 3) -> Any:
    text = transformers.LlamaConfig(
        vocab_size=TV,
        hidden_size=TH,
        intermediate_size=TF,
        num_hidden_layers=TL,
        num_attention_heads=THEADS,
        num_key_value_heads=TKV,
        max_position_embeddings=TP,
        tie_word_embeddings=False,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision_config(),
        text_config=text,
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    return _randomize(transformers.LlavaForConditionalGeneration(cfg), seed=seed)


# transformers' LLaVA key prefixes <-> the original LLaVA release's two directories.
TO_ORIGINAL = (
    ("model.vision_tower.", "image_model", "vision_model."),
    ("model.language_model.", "text_model", "model."),
    ("lm_head.", "text_model", "lm_head."),
)


def to_original(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = {"image_model": {}, "text_model": {}}
    for k, v in sd.items():
        if k.startswith("model.multi_modal_projector.linear_"):
            n, wb = k[len("model.multi_modal_projector.linear_") :].split(".")
            parts["text_model"][f"model.mm_projector.{2 * (int(n) - 1)}.{wb}"] = v.clone()
            continue
        for prefix, part, new in TO_ORIGINAL:
            if k.startswith(prefix):
                parts[part][new + k[len(prefix) :]] = v.clone()
                break
        else:
            raise AssertionError(f"unexpected LLaVA key {k}")
    return parts


def from_original(parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in parts["text_model"].items():
        if k.startswith("model.mm_projector."):
            n, wb = k[len("model.mm_projector.") :].split(".")
            out[f"model.multi_modal_projector.linear_{int(n) // 2 + 1}.{wb}"] = v
        elif k.startswith("model."):
            out["model.language_model." + k[len("model.") :]] = v
        else:
            out[k] = v
    for k, v in parts["image_model"].items():
        out["model.vision_tower." + k[len("vision_model.") :]] = v
    return out


def llava_text_config(**overrides: Any) -> dict[str, Any]:
    """The text model's config.json as the original LLaVA release writes it."""
    cfg = llava_model().config.text_config.to_dict()
    cfg.update(
        model_type="llava",
        architectures=["LlavaLlamaForCausalLM"],
        mm_hidden_size=VH,
        mm_projector_type="mlp2x_gelu",
        mm_vision_select_layer=-2,
        mm_vision_select_feature="patch",
        mm_use_im_start_end=False,
        mm_use_im_patch_token=False,
        tune_mm_mlp_adapter=False,
        mm_vision_tower="openai/clip-vit-large-patch14",
        image_aspect_ratio="pad",
    )
    cfg.update(overrides)
    return cfg


def write_original(
    root: Path,
    model: Any,
    *,
    text_config: dict[str, Any] | None = None,
    projector: bool = True,
    vision_prefix: str = "vision_model.",
    safetensors_text: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    parts = to_original(model.state_dict())
    if not projector:
        parts["text_model"] = {k: v for k, v in parts["text_model"].items() if "mm_projector" not in k}
    image = {vision_prefix + k[len("vision_model.") :]: v for k, v in parts["image_model"].items()}
    (root / "image_model").mkdir(parents=True)
    (root / "text_model").mkdir()
    save_file(image, str(root / "image_model" / "model.safetensors"), metadata={"format": "pt"})
    vc = {**model.config.vision_config.to_dict(), "architectures": ["CLIPVisionModel"]}
    (root / "image_model" / "config.json").write_text(json.dumps(vc))
    (root / "image_model" / "preprocessor_config.json").write_text(json.dumps({"crop_size": IMG, "size": IMG}))
    if safetensors_text:
        save_file(parts["text_model"], str(root / "text_model" / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(parts["text_model"], root / "text_model" / "pytorch_model.bin")
    (root / "text_model" / "config.json").write_text(json.dumps(text_config or llava_text_config()))
    return parts


# --- the Cerebras key set, from the reference ---------------------------------------------------

CS_IMAGE = {
    "embedding_layer.cls_embedding": (VH,),
    "embedding_layer.position_embeddings.weight": ((IMG // PATCH) ** 2 + 1, VH),
    "embedding_layer.linear_proj.weight": (VH, 3, PATCH, PATCH),
    "embedding_layer.post_embed_ln.weight": (VH,),
    "embedding_layer.post_embed_ln.bias": (VH,),
    "encoder.transformer_encoder.norm.weight": (VH,),
    "encoder.transformer_encoder.norm.bias": (VH,),
}
for _i in range(VL):
    for _name, _shape in {
        "self_attn.proj_q_dense_layer": (VH, VH),
        "self_attn.proj_k_dense_layer": (VH, VH),
        "self_attn.proj_v_dense_layer": (VH, VH),
        "self_attn.proj_output_dense_layer": (VH, VH),
        "ffn.ffn.0.linear_layer": (VF, VH),
        "ffn.ffn.1.linear_layer": (VH, VF),
        "norm1": (VH,),
        "norm2": (VH,),
    }.items():
        CS_IMAGE[f"encoder.transformer_encoder.layers.{_i}.{_name}.weight"] = _shape
        CS_IMAGE[f"encoder.transformer_encoder.layers.{_i}.{_name}.bias"] = (_shape[0],)

TD = TH // THEADS
CS_TEXT = {
    "embedding_layer.word_embeddings.weight": (TV, TH),
    "transformer_decoder.norm.weight": (TH,),
    "ln_f.weight": (TH,),
    "lm_head.weight": (TV, TH),
}
for _i in range(TL):
    for _name, _shape in {
        "self_attn.proj_q_dense_layer.weight": (TH, TH),
        "self_attn.proj_k_dense_layer.weight": (TKV * TD, TH),
        "self_attn.proj_v_dense_layer.weight": (TKV * TD, TH),
        "self_attn.proj_output_dense_layer.weight": (TH, TH),
        "norm1.weight": (TH,),
        "norm3.weight": (TH,),
        "ffn.ffn.0.linear_layer.weight": (TF, TH),
        "ffn.ffn.0.linear_layer_for_glu.weight": (TF, TH),
        "ffn.ffn.1.linear_layer.weight": (TH, TF),
    }.items():
        CS_TEXT[f"transformer_decoder.layers.{_i}.{_name}"] = _shape

CS_PROJECTOR = {
    "projector_image_model.ffn.0.linear_layer.weight": (TH, VH),
    "projector_image_model.ffn.0.linear_layer.bias": (TH,),
    "projector_image_model.ffn.1.linear_layer.weight": (TH, TH),
    "projector_image_model.ffn.1.linear_layer.bias": (TH,),
}
CS_KEYS = {
    **{f"model.image_model.{k}": s for k, s in CS_IMAGE.items()},
    **{f"model.text_model.{k}": s for k, s in CS_TEXT.items()},
    **{f"model.{k}": s for k, s in CS_PROJECTOR.items()},
}


def _yaml(result: Any) -> tuple[str, dict[str, Any]]:
    path = next(o.uri for o in result.outputs if o.uri.endswith(".yaml"))
    return path, yaml.safe_load(Path(path).read_text())


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    n_image = (IMG // PATCH) ** 2  # "default" selection drops the class token
    text = torch.randint(0, TV - 1, (2, 6), generator=g)
    ids = torch.cat([text[:, :2], torch.full((2, n_image), IMAGE_TOKEN), text[:, 2:]], dim=1)
    return ids, torch.randn(2, 3, IMG, IMG, generator=g)


def test_hf_to_cs_and_back(tmp_path: Path) -> None:
    model = llava_model()
    original = write_original(tmp_path / "hf", model)

    plan = plan_model(str(tmp_path / "hf"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")
    # The only warning lists the config keys no rule maps (generic transformers fields among them).
    assert not plan.unmatched and len(plan.steps) == len(CS_KEYS)
    assert [w for w in plan.warnings if "Key not matched" not in w] == []
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")
    assert r.target.endswith("/cs/pytorch_model_to_cs-2.9.mdl")
    cs = load_cs(r.target)
    assert set(cs) == set(CS_KEYS), (sorted(set(cs) - set(CS_KEYS)), sorted(set(CS_KEYS) - set(cs)))
    for k, shape in CS_KEYS.items():
        assert tuple(cs[k].shape) == shape, k
    # The class token's position row moves from first (HF) to last (CS); the projector re-indexes.
    hf_pos = original["image_model"]["vision_model.embeddings.position_embedding.weight"]
    assert torch.equal(cs["model.image_model.embedding_layer.position_embeddings.weight"][-1], hf_pos[0])
    assert torch.equal(
        cs["model.projector_image_model.ffn.1.linear_layer.weight"],
        original["text_model"]["model.mm_projector.2.weight"],
    )

    cfg_path, doc = _yaml(r)
    m = doc["model"]
    assert m["image_model"]["name"] == "ViTModel" and m["text_model"]["name"] == "LlamaModel"
    assert m["image_model"]["image_size"] == [IMG, IMG] and m["image_model"]["nonlinearity"] == "quick_gelu"
    assert m["text_model"]["extra_attention_params"] == {"num_kv_groups": TKV}
    assert m["projector"] == {
        "image_model": {
            "name": "FeedForwardNetwork",
            "input_unit": VH,
            "layers_units": [TH, TH],
            "layers_activation": ["gelu", None],
            "use_bias": True,
        }
    }
    assert m["freeze"] == ["^image_model"]
    assert m["image_feature_select_layer_idx"] == -2 and m["image_feature_select_mode"] == "patch"

    with pytest.raises(ConfigConversionError, match="run config"):  # an imported .mdl holds no config
        plan_model(r.target, model="llava", src_fmt="cs-auto", tgt_fmt="hf")
    back = convert_model(
        r.target, str(tmp_path / "back"), model="llava", src_fmt="cs-auto", tgt_fmt="hf", config=cfg_path
    )
    out = Path(back.target)
    assert sorted(p.name for p in (out / "image_model").iterdir()) == [
        "config.json",
        "preprocessor_config.json",
        "pytorch_model-00001-of-00001.bin",
        "pytorch_model.bin.index.json",
    ]
    got = {part: load_dir(str(out / part)) for part in ("image_model", "text_model")}
    for part in ("image_model", "text_model"):
        assert set(got[part]) == set(original[part]), part
        for k, v in original[part].items():
            assert torch.equal(got[part][k], v), k

    text_cfg = json.loads((out / "text_model" / "config.json").read_text())
    want = llava_text_config()
    for k in ("mm_hidden_size", "mm_projector_type", "mm_vision_select_layer", "mm_vision_select_feature"):
        assert text_cfg[k] == want[k], k
    assert text_cfg["architectures"] == ["LlavaLlamaForCausalLM"]
    assert text_cfg["mm_vision_tower"] == f"{back.target}/image_model"
    pre = json.loads((out / "image_model" / "preprocessor_config.json").read_text())
    assert pre["crop_size"] == {"height": IMG, "width": IMG} and pre["size"] == IMG

    # Each directory loads with transformers' own classes and computes what the original parts did.
    ids, pixels = _inputs()
    tower = transformers.CLIPVisionModel.from_pretrained(out / "image_model").eval()
    lm = transformers.LlamaForCausalLM.from_pretrained(out / "text_model").eval()
    with torch.no_grad():
        assert torch.equal(tower(pixels).last_hidden_state, model.model.vision_tower(pixels).last_hidden_state)
        text_ids = ids[:, :2]
        assert torch.equal(lm(text_ids).logits, model(input_ids=text_ids).logits)
    # The whole multimodal model, reassembled from the two converted directories: same logits.
    rebuilt = llava_model(seed=99)
    missing, unexpected = rebuilt.load_state_dict(from_original(got), strict=True)
    assert not missing and not unexpected
    with torch.no_grad():
        want_logits = model(input_ids=ids, pixel_values=pixels).logits
        assert torch.equal(rebuilt.eval()(input_ids=ids, pixel_values=pixels).logits, want_logits)


def test_projector_initialized_when_absent(tmp_path: Path) -> None:
    model = llava_model()
    write_original(tmp_path / "hf", model, projector=False, safetensors_text=True)
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")
    assert any("new projector was initialized" in w for w in r.warnings)
    cs = load_cs(r.target)
    assert set(cs) == set(CS_KEYS)
    for i, n_in in enumerate((VH, TH)):
        for wb in ("weight", "bias"):
            t = cs[f"model.projector_image_model.ffn.{i}.linear_layer.{wb}"]
            assert t.dtype == torch.float32 and t.abs().max() <= n_in**-0.5 and t.std() > 0.3 * n_in**-0.5
    again = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs2"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")
    cs2 = load_cs(again.target)
    assert all(torch.equal(cs[k], cs2[k]) for k in cs)  # seeded: a conversion is reproducible


def test_transformers5_tower_and_dropped_keys(tmp_path: Path) -> None:
    """A tower saved without ``vision_model.`` (transformers 5) converts; the LLaVA checkpoint's own
    copy of the tower (``model.vision_tower.*``) is dropped, as image_model/ is the tower."""
    model = llava_model()
    parts = write_original(tmp_path / "hf", model, vision_prefix="")
    text = dict(parts["text_model"])
    text["model.vision_tower.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(VH)
    torch.save(text, tmp_path / "hf" / "text_model" / "pytorch_model.bin")
    plan = plan_model(str(tmp_path / "hf"), model="llava", src_fmt="hf", tgt_fmt="cs-2.5")
    assert plan.dropped == ["model.vision_tower.vision_tower.vision_model.post_layernorm.weight"]
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="llava", src_fmt="hf", tgt_fmt="cs-2.5")
    assert set(load_cs(r.target)) == set(CS_KEYS)


def test_config_options_and_refusals(tmp_path: Path) -> None:
    model = llava_model()
    write_original(
        tmp_path / "tune",
        model,
        text_config=llava_text_config(tune_mm_mlp_adapter=True, mm_vision_select_layer=3),
    )
    plan = plan_model(str(tmp_path / "tune"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")
    assert plan.config["model"]["freeze"] == ["^image_model", "^text_model"]
    assert plan.config["model"]["image_feature_select_layer_idx"] == 2  # HF counts the embeddings

    with pytest.raises(NoConversionPath, match=r"cs-2\.2"):
        plan_model(str(tmp_path / "tune"), model="llava", src_fmt="hf", tgt_fmt="cs-2.1")
    for i, (overrides, match) in enumerate(
        [
            ({"mm_use_im_start_end": True}, "mm_use_im_start_end"),
            ({"mm_hidden_size": 64}, "mm_hidden_size"),
            ({"mm_projector_type": "linear"}, "mm_projector_type"),
            ({"mm_vision_select_layer": 0}, "mm_vision_select_layer"),
        ]
    ):
        write_original(tmp_path / f"bad{i}", model, text_config=llava_text_config(**overrides))
        with pytest.raises(ConfigConversionError, match=match):
            plan_model(str(tmp_path / f"bad{i}"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")

    parts = write_original(tmp_path / "odd", model)
    text = {k.replace("mm_projector.2", "mm_projector.1"): v for k, v in parts["text_model"].items()}
    torch.save(text, tmp_path / "odd" / "text_model" / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="odd position"):
        plan_model(str(tmp_path / "odd"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")

    parts = write_original(tmp_path / "extra", model)
    torch.save({**parts["text_model"], "model.stray.weight": torch.ones(2)}, tmp_path / "extra/text_model/x.bin")
    os.remove(tmp_path / "extra" / "text_model" / "pytorch_model.bin")
    with pytest.raises(UnmatchedKeys, match=r"model\.stray\.weight"):
        convert_model(str(tmp_path / "extra"), str(tmp_path / "o"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    r = convert_model(
        str(tmp_path / "extra"),
        str(tmp_path / "o2"),
        model="llava",
        src_fmt="hf",
        tgt_fmt="cs-2.9",
        drop_unmatched_keys=True,
    )
    assert any("model.stray.weight" in w for w in r.warnings)


def test_cs_config_required_sections(tmp_path: Path) -> None:
    model = llava_model()
    write_original(tmp_path / "hf", model)
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="llava", src_fmt="hf", tgt_fmt="cs-2.9")
    _, doc = _yaml(r)
    del doc["model"]["projector"]
    with pytest.raises(ConfigConversionError, match="projector"):
        plan_model(r.target, model="llava", src_fmt="cs-2.9", tgt_fmt="hf", config=doc)
    with pytest.raises(NoConversionPath, match=r"image_model/config\.json and text_model/config\.json"):
        convert_config_dict(_yaml(r)[1], model="llava", src_fmt="cs-2.9", tgt_fmt="hf")
    doc = _yaml(r)[1]
    doc["model"]["projector"]["image_model"]["layers_activation"] = ["relu", None]
    with pytest.raises(ConfigConversionError, match="layers_activation"):
        plan_model(r.target, model="llava", src_fmt="cs-2.9", tgt_fmt="hf", config=doc)


# --- CLIP-ViT on its own --------------------------------------------------------------------------


def test_clip_vit_roundtrip_and_classifier(tmp_path: Path) -> None:
    tower = _randomize(transformers.CLIPVisionModel(vision_config()), seed=7)
    tower.save_pretrained(tmp_path / "hf")  # transformers 5: keys without vision_model.
    original = load_dir(str(tmp_path / "hf"))
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="clip-vit", src_fmt="hf", tgt_fmt="cs-2.9")
    cs = load_cs(r.target)
    want = {f"model.vit_model.{k}": s for k, s in CS_IMAGE.items()}
    want["model.classifier.classifier.ffn.0.linear_layer.weight"] = (PROJ, VH)
    assert {k: tuple(v.shape) for k, v in cs.items()} == want
    head = cs["model.classifier.classifier.ffn.0.linear_layer.weight"]
    assert 0.01 < float(head.std()) < 0.03  # N(0, 0.02): the CS classifier has no HF counterpart
    assert any("initialized" in w and "classifier" in w for w in r.warnings)
    cfg_path, doc = _yaml(r)
    assert doc["model"]["num_classes"] == PROJ and doc["model"]["patch_size"] == [PATCH, PATCH]

    back = convert_model(
        r.target, str(tmp_path / "back"), model="clip-vit", src_fmt="cs-2.9", tgt_fmt="hf", config=cfg_path
    )
    got = load_dir(back.target)
    assert set(got) == {f"vision_model.{k}" for k in original}
    assert all(torch.equal(got[f"vision_model.{k}"], v) for k, v in original.items())
    cfg = json.loads((Path(back.target) / "config.json").read_text())
    assert cfg["model_type"] == "clip_vision_model" and cfg["image_size"] == IMG and cfg["projection_dim"] == PROJ
    loaded = transformers.CLIPVisionModel.from_pretrained(back.target).eval()
    pixels = torch.randn(2, 3, IMG, IMG, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(pixels).pooler_output, tower(pixels).pooler_output)


def test_clip_vit_from_full_clip_model(tmp_path: Path) -> None:
    """A CLIPModel: the vision tower converts, the text tower and projections are dropped."""
    text = transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    clip = transformers.CLIPModel(
        transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision_config().to_dict())
    )
    clip.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())["vision_config"]
    plan = plan_model(str(tmp_path / "hf"), model="clip-vit", src_fmt="hf", tgt_fmt="cs-2.9", config=cfg)
    assert not plan.unmatched
    assert {k.split(".")[0] for k in plan.dropped} >= {"text_model", "visual_projection", "text_projection"}
    assert len([s for s in plan.steps if s.out.key.startswith("model.vit_model.")]) == len(CS_IMAGE)

    # Cerebras allows rectangular images; a Hugging Face CLIP config cannot say them.
    doc = {"model": {**plan.config["model"], "image_size": [IMG, IMG * 2]}}
    with pytest.raises(ConfigConversionError, match="width and height"):
        convert_config_dict(doc, model="clip-vit", src_fmt="cs-2.9", tgt_fmt="hf")
