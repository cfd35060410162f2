"""muP -> sP folding (checked numerically with the appliance simulator) and LoRA folding."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from tiny_models import tiny_llama_config

from ckptconv.core.errors import ConfigConversionError, ConversionError
from ckptconv.engine.layouts.api import convert_model
from ckptconv.engine.layouts.folding import is_mup, mup_fold

transformers = pytest.importorskip("transformers")
T = transformers


def _tiny(model: str):
    g = torch.Generator().manual_seed(0)
    if model == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    else:
        m = T.LlamaForCausalLM(tiny_llama_config())
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def _to_cs(tmp: Path, model: str) -> tuple[str, dict]:
    _tiny(model).save_pretrained(tmp / "hf")
    r = convert_model(str(tmp / "hf"), str(tmp / "cs"), model=model, src_fmt="hf", tgt_fmt="cs-2.9")
    cfg = next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))
    return r.target, yaml.safe_load(Path(cfg).read_text())


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_mup_folded_hf_model_computes_what_the_mup_model_computed(tmp_path: Path, model: str) -> None:
    from ckptconv.engine.simulator.verify import verify

    mdl, doc = _to_cs(tmp_path, model)
    doc["model"].update(
        mup_base_hidden_size=32,
        mup_base_filter_size=64,
        attention_logits_alpha=0.7,
        output_logits_alpha=1.3,
        embeddings_scale=2.5,
        scale_qk_dot_by_d=True,
    )
    mup_cfg = tmp_path / "mup.yaml"
    mup_cfg.write_text(yaml.safe_dump(doc))
    r = convert_model(mdl, str(tmp_path / "out"), model=model, src_fmt="cs-2.9", tgt_fmt="hf", config=str(mup_cfg))
    assert any("muP" in w for w in r.warnings)
    hf_cfg = json.loads((Path(r.target) / "config.json").read_text())
    assert hf_cfg["tie_word_embeddings"] is False and not any("mup" in k for k in hf_cfg)
    # the simulator runs the muP model of the CS checkpoint; transformers runs the folded sP export
    report = verify(r.target, mdl, str(mup_cfg), model, tolerance=1e-5, rtol=1e-6)
    assert report["passed"], report["outputs"]
    # and without folding the models differ (the check can fail)
    plain = convert_model(
        mdl,
        str(tmp_path / "plain"),
        model=model,
        src_fmt="cs-2.9",
        tgt_fmt="hf",
        config=str(tmp_path / "cs" / "config_to_cs-2.9.yaml"),
    )
    assert not verify(plain.target, mdl, str(mup_cfg), model)["passed"]


def test_mup_factors_follow_the_reference() -> None:
    cfg = {
        "hidden_size": 64,
        "num_heads": 4,
        "mup_base_hidden_size": 16,
        "attention_logits_alpha": 2.0,
        "output_logits_alpha": 3.0,
        "embeddings_scale": 5.0,
        "share_embedding_weights": True,
    }
    f = mup_fold(cfg, "2.9")
    w = 64 / 16
    assert f.factor("transformer_decoder.layers.3.self_attn.proj_k_dense_layer.bias")[0] == 2.0 / math.sqrt(16)
    assert f.factor("lm_head.weight")[0] == 3.0 / w
    assert f.factor("embedding_layer.word_embeddings.weight")[0] == 5.0
    assert f.factor("bert_encoder.embedding_layer.position_embeddings.embed.weight")[0] == 5.0
    assert f.factor("transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight") is None
    assert f.config["share_embedding_weights"] is False and "mup_base_hidden_size" not in f.config
    sqrt_out = mup_fold({**cfg, "scale_output_logits_by_d": False}, "2.9")
    assert sqrt_out.factor("lm_head.weight")[0] == 3.0 / math.sqrt(w)
    ln = mup_fold({**cfg, "embedding_layer_norm": True}, "2.9")
    assert ln.factor("embedding_ln_f.bias")[0] == 5.0 and ln.factor("embedding_layer.word_embeddings.weight") is None
    old = {
        "hidden_size": 64,
        "num_heads": 4,
        "scale_qk_dot_by_d": True,
        "embeddings_scale": 2.0,
        "output_logits_scale": 0.5,
    }
    assert is_mup(old, "2.2") and mup_fold(old, "2.2").factor("lm_head.weight")[0] == 0.5
    with pytest.raises(ConfigConversionError, match="not all"):
        is_mup({**old, "output_logits_scale": None}, "2.2")


def _cs_model(mdl: str) -> dict:
    """The ``model`` state of a Cerebras checkpoint, keys without ``model.``."""
    from ckptconv.formats.detect import open_source

    src = open_source(mdl)
    try:
        return {e.key[len("model.") :]: src.read(e.key) for e in src.entries()}
    finally:
        src.close()


def _with_lora(tmp: Path) -> tuple[str, Path, dict]:
    from ckptconv.engine.simulator.checkpoint_io import write_checkpoint

    mdl, doc = _to_cs(tmp, "llama")
    model = _cs_model(mdl)
    g = torch.Generator().manual_seed(5)
    q = "transformer_decoder.layers.0.self_attn.proj_q_dense_layer"
    emb = "embedding_layer.word_embeddings"
    model[f"{q}.lora_A"], model[f"{q}.lora_B"] = torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g)
    model[f"{emb}.lora_A"], model[f"{emb}.lora_B"] = torch.randn(4, 256, generator=g), torch.randn(64, 4, generator=g)
    lora_mdl = str(tmp / "lora.mdl")
    write_checkpoint(lora_mdl, {"model": model}, cstorch_version="2.9.0")
    doc["model"]["lora_params"] = {"r": 4, "alpha": 8, "target_modules": None}
    doc["model"]["share_embedding_weights"] = True
    cfg = tmp / "lora.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    return lora_mdl, cfg, model


def test_lora_fold_cs_to_cs_and_to_hf(tmp_path: Path) -> None:
    lora_mdl, cfg, model = _with_lora(tmp_path)
    q = "transformer_decoder.layers.0.self_attn.proj_q_dense_layer"
    emb = "embedding_layer.word_embeddings"
    with pytest.raises(ConversionError, match="fold-lora"):
        convert_model(lora_mdl, str(tmp_path / "x"), model="llama", src_fmt="cs-2.9", tgt_fmt="hf", config=str(cfg))

    r = convert_model(
        lora_mdl,
        str(tmp_path / "folded"),
        model="llama",
        src_fmt="cs-2.9",
        tgt_fmt="cs-2.9",
        config=str(cfg),
        fold_lora=True,
    )
    from ckptconv.formats.detect import open_source

    out = open_source(r.target)
    try:
        folded = {e.key[len("model.") :]: out.read(e.key) for e in out.entries() if e.key.startswith("model.")}
    finally:
        out.close()
    assert not any("lora" in k for k in folded)
    want_q = model[f"{q}.weight"] + 2.0 * (model[f"{q}.lora_B"] @ model[f"{q}.lora_A"])
    torch.testing.assert_close(folded[f"{q}.weight"], want_q)
    want_e = model[f"{emb}.weight"] + 2.0 * (model[f"{emb}.lora_B"] @ model[f"{emb}.lora_A"]).T
    torch.testing.assert_close(folded[f"{emb}.weight"], want_e)
    new_cfg = yaml.safe_load(next(Path(o.uri) for o in r.outputs if o.uri.endswith(".yaml")).read_text())
    m = new_cfg["trainer"]["init"]["model"] if "trainer" in new_cfg else new_cfg["model"]
    assert "lora_params" not in m and m["share_embedding_weights"] is False

    hf = convert_model(
        lora_mdl,
        str(tmp_path / "hf_out"),
        model="llama",
        src_fmt="cs-2.9",
        tgt_fmt="hf",
        config=str(cfg),
        fold_lora=True,
        export_safetensors=True,
    )
    from safetensors.torch import load_file

    sd = load_file(next(Path(hf.target).glob("*.safetensors")))
    from ckptconv.engine.layouts.transforms import rope_permute

    torch.testing.assert_close(sd["model.layers.0.self_attn.q_proj.weight"], rope_permute(want_q, 16, 16, to_cs=False))
    torch.testing.assert_close(sd["model.embed_tokens.weight"], want_e)


@pytest.mark.parametrize("section", ["sparsity", "trainer"])
def test_sideband_sparsity_nans_become_zeros_on_export(tmp_path: Path, section: str) -> None:
    from ckptconv.engine.simulator.checkpoint_io import write_checkpoint

    mdl, doc = _to_cs(tmp_path, "llama")
    model = _cs_model(mdl)
    q = "transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"
    pruned = model[q].clone()
    pruned[::2, 1::3] = float("nan")  # sideband sparsity marks pruned weights as NaN
    pruned[0, 0] = float("inf")  # only NaN is a mask: other values stay
    model[q] = pruned
    sparse = str(tmp_path / "sparse.mdl")
    write_checkpoint(sparse, {"model": model}, cstorch_version="2.9.0")
    cfg = tmp_path / "sparse.yaml"

    cfg.write_text(yaml.safe_dump(doc))
    plain = convert_model(
        sparse, str(tmp_path / "plain"), model="llama", src_fmt="cs-2.9", tgt_fmt="hf", config=str(cfg)
    )
    if section == "sparsity":
        doc["sparsity"] = {"type": "sideband", "sparsity": 0.5}
    else:
        doc = {"trainer": {"init": {"model": doc["model"], "sparsity": {"algorithm": "sideband"}}}}
    cfg.write_text(yaml.safe_dump(doc))
    r = convert_model(sparse, str(tmp_path / "hf_out"), model="llama", src_fmt="cs-2.9", tgt_fmt="hf", config=str(cfg))
    assert any("sideband" in w for w in r.warnings)
    st = next(Path(r.target).glob("*.bin"))
    got = torch.load(st, weights_only=True)["model.layers.0.self_attn.q_proj.weight"]
    before = torch.load(next(Path(plain.target).glob("*.bin")), weights_only=True)
    assert before["model.layers.0.self_attn.q_proj.weight"].isnan().any()  # without the setting NaN stays
    assert not got.isnan().any() and got.isinf().sum() == 1
    assert (got == 0).sum() >= pruned.isnan().sum()


@pytest.mark.parametrize("per_kv", [False, True])
def test_t5_mup_factors_land_on_their_tensors(tmp_path: Path, per_kv: bool) -> None:
    """T5's muP folding (reference 6.1, T5 line) applied key by key; the HF model then loads.

    The simulator has no T5 muP forward to compare logits with, so this checks the factors of the
    reference on every tensor they apply to, and that nothing else changes."""
    hf = T.T5ForConditionalGeneration(
        T.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, tie_word_embeddings=False)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hf.save_pretrained(tmp_path / "hf")
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="t5", src_fmt="hf", tgt_fmt="cs-2.9")
    cfg = Path(next(o.uri for o in r.outputs if o.uri.endswith(".yaml")))
    doc = yaml.safe_load(cfg.read_text())
    mup = {
        "mup_base_d_model": 16,
        "encoder_attention_logits_alpha": 2.0,
        "decoder_attention_logits_alpha": 3.0,
        "output_logits_alpha": 5.0,
        "embeddings_alpha": 0.5,
    }
    if per_kv:
        mup["mup_base_d_kv"] = 8
    doc["model"].update(mup)
    cfg.write_text(yaml.safe_dump(doc))
    back = convert_model(r.target, str(tmp_path / "out"), model="t5", src_fmt="cs-2.9", tgt_fmt="hf", config=str(cfg))
    assert any("muP" in w for w in back.warnings)
    out = torch.load(next(Path(back.target).glob("*.bin")), weights_only=True)
    orig = hf.state_dict()
    w, p = 64 / 16, (1.0 if per_kv else (64 / 16) ** -0.5)
    expect = {"q": p / 4, "v": p, "o": 1.0 if per_kv else w**0.5}
    seen = set()
    for key, value in orig.items():
        if key not in out:
            continue
        seen.add(key.rsplit(".", 2)[-2] if "Attention" in key else key)
        if key.endswith(("SelfAttention.q.weight", "EncDecAttention.q.weight")):
            f = expect["q"]
        elif key.endswith(("SelfAttention.k.weight", "EncDecAttention.k.weight")):
            f = (2.0 if key.startswith("encoder.") else 3.0) * p / 4
        elif key.endswith((".v.weight",)):
            f = expect["v"]
        elif key.endswith((".o.weight",)):
            f = expect["o"]
        elif key == "lm_head.weight":
            f = 5.0 / math.sqrt(w)  # scale_output_logits_by_d defaults to false for T5
        elif key in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            f = 0.5 * math.sqrt(64)
        else:
            f = 1.0
        torch.testing.assert_close(out[key], value * f, rtol=1e-6, atol=1e-6, msg=key)
    assert {"q", "k", "v", "o", "lm_head.weight", "shared.weight"} <= seen, seen
    hf_cfg = json.loads((Path(back.target) / "config.json").read_text())
    assert hf_cfg["tie_word_embeddings"] is False and not [k for k in hf_cfg if "mup" in k or "alpha" in k]
    T.T5ForConditionalGeneration.from_pretrained(back.target)
