"""Every model family, end to end through files: HF -> CS -> HF with tiny random models.

For each family a tiny model (2 layers, hidden 64, 4 heads, vocab 256, float32, every parameter
random) is built with ``transformers`` from a config (no downloads) and saved with
``save_pretrained`` (safetensors, so tied duplicates are omitted as transformers does). Then:

- HF -> cs-2.9: the CS checkpoint holds exactly the keys and shapes of the reference layout
  (complete: tied partners omitted by the input are filled);
- cs-2.9 -> HF: every tensor of the original comes back bit-identical (``torch.equal``); extra keys
  are only regenerated buffers and tied duplicates;
- the HF output loads with ``from_pretrained`` and computes the original model's logits exactly;
- the converted config.json is equivalent to the original for every mapped field.

Families without a transformers class (remote-code SantaCoder, BTLM, JAIS) use a synthetic state
dict of the right names and shapes; they check the round trip only.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
T = transformers

from ckptconv.engine.layouts.api import convert_model  # noqa: E402

L, H, NH, V, P = 2, 64, 4, 256, 128  # layers, hidden, heads, vocab, positions


def _randomize(model: Any, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


# --- expected CS key sets -----------------------------------------------------------------------


def dec(layer_keys: dict[str, tuple[int, ...]], top: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    out = dict(top)
    for i in range(L):
        for k, shape in layer_keys.items():
            out[f"transformer_decoder.layers.{i}.{k}"] = shape
    return out


def attn(q: int, kv: int, bias: bool, out_bias: bool | None = None) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {}
    for name, rows in (("q", q), ("k", kv), ("v", kv)):
        d[f"self_attn.proj_{name}_dense_layer.weight"] = (rows, H)
        if bias:
            d[f"self_attn.proj_{name}_dense_layer.bias"] = (rows,)
    d["self_attn.proj_output_dense_layer.weight"] = (H, q)
    if bias if out_bias is None else out_bias:
        d["self_attn.proj_output_dense_layer.bias"] = (H,)
    return d


def ffn(f: int, bias: bool, glu: bool = False) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {"ffn.ffn.0.linear_layer.weight": (f, H), "ffn.ffn.1.linear_layer.weight": (H, f)}
    if glu:
        d["ffn.ffn.0.linear_layer_for_glu.weight"] = (f, H)
    if bias:
        d["ffn.ffn.0.linear_layer.bias"] = (f,)
        d["ffn.ffn.1.linear_layer.bias"] = (H,)
        if glu:
            d["ffn.ffn.0.linear_layer_for_glu.bias"] = (f,)
    return d


def norms(*names: str, bias: bool) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {}
    for n in names:
        d[f"{n}.weight"] = (H,)
        if bias:
            d[f"{n}.bias"] = (H,)
    return d


def final(bias: bool, head_bias: bool = False) -> dict[str, tuple[int, ...]]:
    d = {"embedding_layer.word_embeddings.weight": (V, H), "lm_head.weight": (V, H)}
    d.update(norms("transformer_decoder.norm", "ln_f", bias=bias))
    if head_bias:
        d["lm_head.bias"] = (V,)
    return d


def llama_keys(kv: int = 2, f: int = 128) -> dict[str, tuple[int, ...]]:
    d = NH and H // NH
    return dec(
        {**attn(H, kv * d, False), **ffn(f, False, glu=True), **norms("norm1", "norm3", bias=False)}, final(False)
    )


def mixtral_keys() -> dict[str, tuple[int, ...]]:
    layer = {**attn(H, 32, False), **norms("norm1", "norm3", bias=False), "ffn.gate.weight": (4, H)}
    layer["ffn.experts.fused_ffns.0.linear_layer.expert_weights"] = (128, 4, H)
    layer["ffn.experts.fused_ffns.0.linear_layer_for_glu.expert_weights"] = (128, 4, H)
    layer["ffn.experts.fused_ffns.1.linear_layer.expert_weights"] = (H, 4, 128)
    return dec(layer, final(False))


def gpt2_keys(f: int = 4 * H) -> dict[str, tuple[int, ...]]:
    top = final(True)
    top["embedding_layer.position_embeddings.embed.weight"] = (P, H)
    return dec({**attn(H, H, True), **ffn(f, True), **norms("norm1", "norm3", bias=True)}, top)


def starcoder_keys() -> dict[str, tuple[int, ...]]:
    top = final(True)
    top["embedding_layer.position_embeddings.embed.weight"] = (P, H)
    return dec({**attn(H, 16, True), **ffn(4 * H, True), **norms("norm1", "norm3", bias=True)}, top)


def gptj_keys(qkv_split: bool = True) -> dict[str, tuple[int, ...]]:
    return dec({**attn(H, H, False), **ffn(4 * H, True), **norms("norm1", bias=True)}, final(True, head_bias=True))


def neox_keys() -> dict[str, tuple[int, ...]]:
    return dec({**attn(H, H, True), **ffn(128, True), **norms("norm1", "norm3", bias=True)}, final(True))


def falcon_keys() -> dict[str, tuple[int, ...]]:
    return dec({**attn(H, 16, False), **ffn(4 * H, False), **norms("norm1", bias=True)}, final(True))


def bloom_keys() -> dict[str, tuple[int, ...]]:
    top = final(True)
    top.update(norms("embedding_ln_f", bias=True))
    top["embedding_layer.position_embed_helper.slopes"] = (NH, 1)
    return dec({**attn(H, H, True), **ffn(4 * H, True), **norms("norm1", "norm3", bias=True)}, top)


def gemma2_keys() -> dict[str, tuple[int, ...]]:
    layer = {**attn(H, 32, False), **ffn(128, False, glu=True)}
    layer.update(norms("norm1", "norm1_post", "norm3", "norm3_post", bias=False))
    return dec(layer, final(False))


def mpt_keys() -> dict[str, tuple[int, ...]]:
    top = final(False)
    top["embedding_layer.position_embed_helper.slopes"] = (NH, 1)
    return dec({**attn(H, H, False), **ffn(4 * H, False), **norms("norm1", "norm3", bias=False)}, top)


def bert_keys(prefix: str = "bert_encoder.", heads: bool = True) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {
        f"{prefix}embedding_layer.word_embeddings.weight": (V, H),
        f"{prefix}embedding_layer.segment_embeddings.weight": (2, H),
        f"{prefix}embedding_layer.position_embeddings.embed.weight": (P, H),
    }
    d.update(norms(f"{prefix}embed_ln_f", bias=True))
    for i in range(L):
        lp = f"{prefix}transformer_encoder.layers.{i}."
        for k, s in {**attn(H, H, True), **ffn(128, True), **norms("norm1", "norm2", bias=True)}.items():
            d[lp + k] = s
    if heads:
        d[f"{prefix}pooler.pooler.ffn.0.linear_layer.weight"] = (H, H)
        d[f"{prefix}pooler.pooler.ffn.0.linear_layer.bias"] = (H,)
        d["bert_mlm_head.mlm_transform.ffn.ffn.0.linear_layer.weight"] = (H, H)
        d["bert_mlm_head.mlm_transform.ffn.ffn.0.linear_layer.bias"] = (H,)
        d.update(norms("bert_mlm_head.mlm_transform.ln", bias=True))
        d["bert_mlm_head.classifier.ffn.0.linear_layer.weight"] = (V, H)
        d["bert_mlm_head.classifier.ffn.0.linear_layer.bias"] = (V,)
        d["bert_cls_head.classifier.ffn.0.linear_layer.weight"] = (2, H)
        d["bert_cls_head.classifier.ffn.0.linear_layer.bias"] = (2,)
    return d


def roberta_keys() -> dict[str, tuple[int, ...]]:
    d = bert_keys(heads=False)
    d["bert_encoder.embedding_layer.position_embeddings.embed.weight"] = (P + 2, H)
    d["bert_mlm_head.mlm_transform.ffn.ffn.0.linear_layer.weight"] = (H, H)
    d["bert_mlm_head.mlm_transform.ffn.ffn.0.linear_layer.bias"] = (H,)
    d.update(norms("bert_mlm_head.mlm_transform.ln", bias=True))
    d["bert_mlm_head.classifier.ffn.0.linear_layer.weight"] = (V, H)
    d["bert_mlm_head.classifier.ffn.0.linear_layer.bias"] = (V,)
    return d


def t5_keys(gated: bool = False) -> dict[str, tuple[int, ...]]:
    d: dict[str, tuple[int, ...]] = {"lm_head.weight": (V, H)}
    for s in ("encoder", "decoder"):
        d[f"{s}_embeddings.word_embeddings.weight"] = (V, H)
        d[f"{s}_embeddings.position_embed_helper.relative_attention_bias.weight"] = (32, NH)
        d[f"{s}.norm.weight"] = (H,)
        for i in range(L):
            p = f"{s}.layers.{i}."
            for k, shape in attn(H, H, False).items():
                d[p + k] = shape
            for k, shape in ffn(128, False, glu=gated).items():
                d[p + k] = shape
            for n in ("norm1", "norm2") + (("norm3",) if s == "decoder" else ()):
                d[f"{p}{n}.weight"] = (H,)
            if s == "decoder":
                for k, shape in attn(H, H, False).items():
                    d[p + k.replace("self_attn", "multihead_attn")] = shape
    return d


# --- cases ------------------------------------------------------------------------------------


@dataclass
class Case:
    model: str
    build: Callable[[], Any]  # a tiny transformers model, or None for synthetic state dicts
    cs_keys: Callable[[], dict[str, tuple[int, ...]]]
    regenerated: set[str] = field(default_factory=set)  # HF keys the export adds (regex-free suffixes)
    config_fields: tuple[str, ...] = ()
    cs_config_keys: int | None = None
    forward: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    exact_tol: float = 0.0
    # The simulator runs the CS model of the converted checkpoint against the HF model. Its
    # tolerance is relative to the largest logit where the Model Zoo maps an HF activation to a
    # slightly different CS one (BLOOM's and Gemma's tanh GELU -> gelu / geglu).
    sim_rtol: float | None = 0.0


def _lm(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


def _t5(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, decoder_input_ids=ids[:, :8]).logits


def _bert(model: Any, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.prediction_logits if hasattr(out, "prediction_logits") else out.logits


LLAMA_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "max_position_embeddings",
)
GPT2_FIELDS = (
    "vocab_size",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
    "activation_function",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "scale_attn_weights",
)

CASES = [
    Case(
        "llama",
        lambda: T.LlamaForCausalLM(
            T.LlamaConfig(
                vocab_size=V,
                hidden_size=H,
                intermediate_size=128,
                num_hidden_layers=L,
                num_attention_heads=NH,
                num_key_value_heads=2,
                max_position_embeddings=P,
            )
        ),
        llama_keys,
        config_fields=LLAMA_FIELDS,
        cs_config_keys=29,
        forward=_lm,
    ),
    Case(
        "mistral",
        lambda: T.MistralForCausalLM(
            T.MistralConfig(
                vocab_size=V,
                hidden_size=H,
                intermediate_size=128,
                num_hidden_layers=L,
                num_attention_heads=NH,
                num_key_value_heads=2,
                max_position_embeddings=P,
                sliding_window=64,
            )
        ),
        llama_keys,
        config_fields=(*LLAMA_FIELDS, "sliding_window"),
        forward=_lm,
    ),
    Case(
        "mixtral",
        lambda: T.MixtralForCausalLM(
            T.MixtralConfig(
                vocab_size=V,
                hidden_size=H,
                intermediate_size=128,
                num_hidden_layers=L,
                num_attention_heads=NH,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=P,
            )
        ),
        mixtral_keys,
        config_fields=(*LLAMA_FIELDS, "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"),
        forward=_lm,
    ),
    Case(
        "gpt2",
        lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=P)),
        gpt2_keys,
        regenerated={"attn.bias", "attn.masked_bias", "lm_head.weight"},
        config_fields=GPT2_FIELDS,
        cs_config_keys=16,
        forward=_lm,
    ),
    Case(
        "gptj",
        lambda: T.GPTJForCausalLM(
            T.GPTJConfig(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, rotary_dim=8, n_positions=P)
        ),
        gptj_keys,
        config_fields=("vocab_size", "n_embd", "n_head", "n_layer", "rotary_dim", "tie_word_embeddings"),
        cs_config_keys=21,
        forward=_lm,
    ),
    Case(
        "codegen",
        lambda: T.CodeGenForCausalLM(
            T.CodeGenConfig(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, rotary_dim=8, n_positions=P, n_ctx=P)
        ),
        gptj_keys,
        config_fields=("vocab_size", "n_embd", "n_head", "n_layer", "rotary_dim", "tie_word_embeddings"),
        forward=_lm,
    ),
    Case(
        "gpt-neox",
        lambda: T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(
                vocab_size=V,
                hidden_size=H,
                intermediate_size=128,
                num_hidden_layers=L,
                num_attention_heads=NH,
                rotary_pct=0.25,
                max_position_embeddings=P,
            )
        ),
        neox_keys,
        regenerated={"attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"},
        config_fields=(
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "hidden_act",
            "tie_word_embeddings",
            "max_position_embeddings",
        ),
        cs_config_keys=22,
        forward=_lm,
    ),
    Case(
        "falcon",
        lambda: T.FalconForCausalLM(
            T.FalconConfig(
                vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, max_position_embeddings=P
            )
        ),
        falcon_keys,
        regenerated={"lm_head.weight"},
        config_fields=(
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "multi_query",
            "parallel_attn",
            "new_decoder_architecture",
            "tie_word_embeddings",
            "bias",
            "alibi",
        ),
        cs_config_keys=27,
        forward=_lm,
    ),
    Case(
        "bloom",
        lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=H, n_layer=L, n_head=NH)),
        bloom_keys,
        regenerated={"lm_head.weight"},
        config_fields=("vocab_size", "hidden_size", "n_head", "n_layer", "layer_norm_epsilon", "tie_word_embeddings"),
        cs_config_keys=18,
        forward=_lm,
        sim_rtol=1e-3,
    ),
    Case(
        "starcoder",
        lambda: T.GPTBigCodeForCausalLM(
            T.GPTBigCodeConfig(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=P)
        ),
        starcoder_keys,
        regenerated={"lm_head.weight"},
        config_fields=(
            "vocab_size",
            "n_embd",
            "n_head",
            "n_layer",
            "n_positions",
            "multi_query",
            "tie_word_embeddings",
        ),
        forward=_lm,
    ),
    Case(
        "gemma2",
        lambda: T.Gemma2ForCausalLM(
            T.Gemma2Config(
                vocab_size=V,
                hidden_size=H,
                intermediate_size=128,
                num_hidden_layers=L,
                num_attention_heads=NH,
                num_key_value_heads=2,
                head_dim=16,
                query_pre_attn_scalar=16,
                max_position_embeddings=P,
                sliding_window=32,
            )
        ),
        gemma2_keys,
        regenerated={"lm_head.weight"},
        config_fields=(
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "sliding_window",
            "final_logit_softcapping",
            "attn_logit_softcapping",
            "query_pre_attn_scalar",
        ),
        forward=_lm,
        exact_tol=1e-5,
        sim_rtol=1e-3,
    ),
    Case(
        "mpt",
        lambda: T.MptForCausalLM(T.MptConfig(vocab_size=V, d_model=H, n_layers=L, n_heads=NH, max_seq_len=P)),
        mpt_keys,
        regenerated={"lm_head.weight"},
        config_fields=("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len", "expansion_ratio", "no_bias"),
        forward=_lm,
        sim_rtol=None,  # the simulator has no transformers class registered for MPT
    ),
    Case(
        "bert",
        lambda: T.BertForPreTraining(
            T.BertConfig(
                vocab_size=V,
                hidden_size=H,
                num_hidden_layers=L,
                num_attention_heads=NH,
                intermediate_size=128,
                max_position_embeddings=P,
            )
        ),
        bert_keys,
        regenerated={"bert.embeddings.position_ids", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"},
        config_fields=(
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "hidden_act",
            "max_position_embeddings",
            "layer_norm_eps",
            "tie_word_embeddings",
        ),
        cs_config_keys=17,
        forward=_bert,
    ),
    Case(
        "roberta",
        lambda: T.RobertaForMaskedLM(
            T.RobertaConfig(
                vocab_size=V,
                hidden_size=H,
                num_hidden_layers=L,
                num_attention_heads=NH,
                intermediate_size=128,
                max_position_embeddings=P + 2,
            )
        ),
        roberta_keys,
        regenerated={"lm_head.decoder.weight", "lm_head.decoder.bias"},
        config_fields=(
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "max_position_embeddings",
            "type_vocab_size",
            "pad_token_id",
            "tie_word_embeddings",
        ),
        forward=_bert,
        sim_rtol=None,  # the simulator reads BERT outputs as prediction_logits; RobertaForMaskedLM says logits
    ),
    Case(
        "t5",
        lambda: T.T5ForConditionalGeneration(
            T.T5Config(vocab_size=V, d_model=H, d_kv=16, d_ff=128, num_layers=L, num_heads=NH)
        ),
        t5_keys,
        regenerated={"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"},
        config_fields=(
            "vocab_size",
            "d_model",
            "d_kv",
            "d_ff",
            "num_layers",
            "num_decoder_layers",
            "num_heads",
            "feed_forward_proj",
            "tie_word_embeddings",
        ),
        cs_config_keys=17,
        forward=_t5,
    ),
    Case(
        "t5",
        lambda: T.T5ForConditionalGeneration(
            T.T5Config(
                vocab_size=V,
                d_model=H,
                d_kv=16,
                d_ff=128,
                num_layers=L,
                num_heads=NH,
                feed_forward_proj="gated-gelu",
                tie_word_embeddings=False,
            )
        ),
        lambda: t5_keys(gated=True),
        regenerated={"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"},
        config_fields=("vocab_size", "d_model", "feed_forward_proj", "scale_decoder_outputs"),
        forward=_t5,
        sim_rtol=1e-3,
    ),
]


def _ids(case: Case) -> str:
    return case.model + ("-gated" if "gated" in repr(case.cs_keys) else "")


# --- helpers ----------------------------------------------------------------------------------


def load_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    for f in sorted(glob.glob(os.path.join(path, "*.bin"))):
        out.update(torch.load(f, weights_only=True))
    return out


def load_cs(path: str) -> dict[str, Any]:
    from ckptconv.formats.detect import open_source

    src = open_source(path)
    try:
        return {e.key: src.read(e.key) for e in src.entries() if e.kind in ("tensor", "array")}
    finally:
        src.close()


def hf_to_cs(hf_dir: str, out: str, model: str, tgt: str = "cs-2.9", **kw: Any) -> tuple[str, str, Any]:
    r = convert_model(hf_dir, out, model=model, src_fmt="hf", tgt_fmt=tgt, **kw)
    mdl = next(o.uri for o in r.outputs if o.uri.endswith(".mdl"))
    yml = next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))
    return mdl, yml, r


def cs_to_hf(mdl: str, yml: str, out: str, model: str, src: str = "cs-2.9", **kw: Any) -> tuple[str, Any]:
    r = convert_model(mdl, out, model=model, src_fmt=src, tgt_fmt="hf", config=yml, **kw)
    return r.target, r


# --- the test -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_roundtrip(case: Case, tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = _randomize(case.build())
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    original = load_dir(hf_dir)

    mdl, yml, _r1 = hf_to_cs(hf_dir, str(tmp_path / "cs"), case.model)
    if case.sim_rtol is not None:
        from ckptconv.engine.simulator.verify import verify

        report = verify(hf_dir, mdl, yml, case.model, tolerance=1e-5, rtol=case.sim_rtol)
        assert report["passed"], report["outputs"]
    cs = load_cs(mdl)
    want = {f"model.{k}": v for k, v in case.cs_keys().items()}
    assert set(cs) == set(want), (sorted(set(cs) - set(want)), sorted(set(want) - set(cs)))
    for k, shape in want.items():
        assert tuple(cs[k].shape) == shape, k
    if case.cs_config_keys is not None:
        import yaml

        with open(yml) as f:
            cs_cfg = yaml.safe_load(f)
        assert list(cs_cfg) == ["model"]
        assert len(cs_cfg["model"]) == case.cs_config_keys, sorted(cs_cfg["model"])

    for export_safetensors in (False, True):
        out_dir, _ = cs_to_hf(
            mdl, yml, str(tmp_path / f"hf_out_{export_safetensors}"), case.model, export_safetensors=export_safetensors
        )
        back = load_dir(out_dir)
        for k, v in original.items():
            assert k in back, k
            if case.exact_tol:
                torch.testing.assert_close(back[k], v, rtol=0, atol=case.exact_tol)
            else:
                assert torch.equal(back[k], v), k
            assert back[k].dtype == v.dtype
        extra = set(back) - set(original)
        assert all(any(k.endswith(s) for s in case.regenerated) for k in extra), sorted(extra)

    # the HF output loads and computes what the original computed
    loaded = type(model).from_pretrained(out_dir).eval()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = case.forward(model, ids), case.forward(loaded, ids)
    if case.exact_tol:
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(a, b)

    cfg_a = model.config
    cfg_b = type(cfg_a).from_pretrained(out_dir)
    for name in case.config_fields:
        assert getattr(cfg_b, name) == getattr(cfg_a, name), name


def test_llama_headless(tmp_path: Any) -> None:
    cfg = T.LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=2,
        max_position_embeddings=P,
    )
    base = _randomize(T.LlamaModel(cfg))
    hf_dir = str(tmp_path / "hf")
    base.save_pretrained(hf_dir)
    mdl, yml, _r = hf_to_cs(hf_dir, str(tmp_path / "cs"), "llama-headless")
    cs = load_cs(mdl)
    assert set(cs) == {f"model.{k}" for k in llama_keys()}
    # untied: the synthesized head is N(0, 0.02), reproducible
    assert 0.01 < float(cs["model.lm_head.weight"].std()) < 0.03
    out_dir, _ = cs_to_hf(mdl, yml, str(tmp_path / "back"), "llama-headless")
    back = load_dir(out_dir)
    orig = load_dir(hf_dir)
    assert set(back) == set(orig)
    assert all(torch.equal(back[k], orig[k]) for k in orig)
    loaded = T.LlamaModel.from_pretrained(out_dir).eval()
    ids = torch.randint(0, V, (1, 8))
    with torch.no_grad():
        assert torch.equal(base(ids).last_hidden_state, loaded(ids).last_hidden_state)


def test_gpt2_headless_tied_head_is_the_embedding(tmp_path: Any) -> None:
    base = _randomize(T.GPT2Model(T.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=P)))
    hf_dir = str(tmp_path / "hf")
    base.save_pretrained(hf_dir)
    mdl, _, _ = hf_to_cs(hf_dir, str(tmp_path / "cs"), "gpt2-headless")
    cs = load_cs(mdl)
    assert torch.equal(cs["model.lm_head.weight"], cs["model.embedding_layer.word_embeddings.weight"])
    assert set(cs) == {f"model.{k}" for k in gpt2_keys()}


def test_tied_head_filled_with_warning(tmp_path: Any) -> None:
    model = _randomize(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=P)))
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    assert "lm_head.weight" not in load_dir(hf_dir)  # transformers omits the tied duplicate
    mdl, _, r = hf_to_cs(hf_dir, str(tmp_path / "cs"), "gpt2")
    assert any("lm_head.weight" in w and "filled" in w for w in r.warnings), r.warnings
    cs = load_cs(mdl)
    assert torch.equal(cs["model.lm_head.weight"], cs["model.embedding_layer.word_embeddings.weight"])


# --- remote-code families: synthetic state dicts ------------------------------------------------


def _synthetic(keys: dict[str, tuple[int, ...]], cfg: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(s, generator=g) for k, s in keys.items()}
    os.makedirs(path)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return sd


def _gpt2_like_hf(q_kv: str) -> dict[str, tuple[int, ...]]:
    keys: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (V, H),
        "transformer.wpe.weight": (P, H),
        "transformer.ln_f.weight": (H,),
        "transformer.ln_f.bias": (H,),
    }
    for i in range(L):
        p = f"transformer.h.{i}."
        keys.update(
            {
                f"{p}ln_1.weight": (H,),
                f"{p}ln_1.bias": (H,),
                f"{p}ln_2.weight": (H,),
                f"{p}ln_2.bias": (H,),
                f"{p}attn.c_proj.weight": (H, H),
                f"{p}attn.c_proj.bias": (H,),
                f"{p}mlp.c_fc.weight": (H, 4 * H),
                f"{p}mlp.c_fc.bias": (4 * H,),
                f"{p}mlp.c_proj.weight": (4 * H, H),
                f"{p}mlp.c_proj.bias": (H,),
            }
        )
        if q_kv == "santacoder":
            keys.update(
                {
                    f"{p}attn.q_attn.weight": (H, H),
                    f"{p}attn.q_attn.bias": (H,),
                    f"{p}attn.kv_attn.weight": (H, 32),
                    f"{p}attn.kv_attn.bias": (32,),
                }
            )
        else:
            keys.update(
                {
                    f"{p}attn.c_attn.weight": (H, 3 * H),
                    f"{p}attn.c_attn.bias": (3 * H,),
                    f"{p}mlp.c_fc2.weight": (H, 4 * H),
                    f"{p}mlp.c_fc2.bias": (4 * H,),
                }
            )
    if q_kv != "santacoder":
        keys["transformer.relative_pe.slopes"] = (NH, 1)
    return keys


REMOTE = [
    (
        "santacoder",
        _gpt2_like_hf("santacoder"),
        {
            "model_type": "gpt2",
            "n_embd": H,
            "n_head": NH,
            "n_layer": L,
            "n_positions": P,
            "vocab_size": V,
            "attention_head_type": "multiquery",
            "tie_word_embeddings": True,
            "activation_function": "gelu_fast",
        },
    ),
    (
        "btlm",
        _gpt2_like_hf("btlm"),
        {
            "model_type": "btlm",
            "n_embd": H,
            "n_head": NH,
            "n_layer": L,
            "n_positions": P,
            "vocab_size": V,
            "n_inner": 4 * H,
            "position_embedding_type": "alibi",
            "mup_width_scale": 0.5,
            "mup_output_alpha": 2.0,
            "mup_embeddings_scale": 10.0,
            "mup_scale_qk_dot_by_d": True,
            "activation_function": "swiglu",
        },
    ),
    (
        "jais",
        _gpt2_like_hf("jais"),
        {
            "model_type": "jais",
            "n_embd": H,
            "n_head": NH,
            "n_layer": L,
            "n_positions": P,
            "vocab_size": V,
            "n_inner": 4 * H,
            "position_embedding_type": "alibi",
            "activation_function": "swiglu",
        },
    ),
]


@pytest.mark.parametrize(("model", "keys", "cfg"), REMOTE, ids=[r[0] for r in REMOTE])
def test_remote_code_roundtrip(
    model: str, keys: dict[str, tuple[int, ...]], cfg: dict[str, Any], tmp_path: Any
) -> None:
    sd = _synthetic(keys, cfg, str(tmp_path / "hf"))
    mdl, yml, _r = hf_to_cs(str(tmp_path / "hf"), str(tmp_path / "cs"), model)
    cs = load_cs(mdl)
    assert "model.lm_head.weight" in cs and "model.ln_f.weight" in cs
    out_dir, _ = cs_to_hf(mdl, yml, str(tmp_path / "back"), model)
    back = load_dir(out_dir)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    extra = set(back) - set(sd)
    assert extra <= {"lm_head.weight"} | {
        f"transformer.h.{i}.attn.{b}" for i in range(L) for b in ("bias", "masked_bias")
    }
    with open(os.path.join(out_dir, "config.json")) as f:
        exported = json.load(f)
    for k, v in cfg.items():
        assert exported.get(k) == v, (k, exported.get(k), v)


# --- fine-tuning heads and headless variants -------------------------------------------------------

BERT_CFG = dict(
    vocab_size=V,
    hidden_size=H,
    num_hidden_layers=L,
    num_attention_heads=NH,
    intermediate_size=128,
    max_position_embeddings=P,
)
HEADS = [
    ("bert-sequence-classifier", lambda: T.BertForSequenceClassification(T.BertConfig(num_labels=3, **BERT_CFG)), 3),
    ("bert-token-classifier", lambda: T.BertForTokenClassification(T.BertConfig(num_labels=5, **BERT_CFG)), 5),
    ("bert-q&a", lambda: T.BertForQuestionAnswering(T.BertConfig(**BERT_CFG)), 2),
]


@pytest.mark.parametrize(("name", "build", "labels"), HEADS, ids=[h[0] for h in HEADS])
def test_bert_finetune_heads(name: str, build: Callable[[], Any], labels: int, tmp_path: Any) -> None:
    from ckptconv.engine.simulator.verify import verify

    model = _randomize(build())
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    mdl, yml, _ = hf_to_cs(hf_dir, str(tmp_path / "cs"), name)
    cs = load_cs(mdl)
    want = {f"model.{k}" for k in bert_keys(prefix="bert.", heads=False)}
    want |= {"model.classifier.weight", "model.classifier.bias"}
    if name == "bert-sequence-classifier":
        want |= {
            "model.bert.pooler.pooler.ffn.0.linear_layer.weight",
            "model.bert.pooler.pooler.ffn.0.linear_layer.bias",
        }
    assert set(cs) == want, sorted(set(cs) ^ want)
    assert cs["model.classifier.weight"].shape == (labels, H)
    report = verify(hf_dir, mdl, yml, "bert-qa" if name == "bert-q&a" else name)  # the simulator's spelling
    assert report["passed"], report["outputs"]
    out_dir, _ = cs_to_hf(mdl, yml, str(tmp_path / "back"), name)
    back, orig = load_dir(out_dir), load_dir(hf_dir)
    assert all(torch.equal(back[k], v) for k, v in orig.items())
    assert set(back) - set(orig) <= {"bert.embeddings.position_ids"}
    loaded = type(model).from_pretrained(out_dir).eval()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(ids), loaded(ids)
    for attr in ("logits", "start_logits", "end_logits"):
        if hasattr(a, attr) and getattr(a, attr) is not None:
            assert torch.equal(getattr(a, attr), getattr(b, attr))
    assert loaded.config.num_labels == model.config.num_labels


HEADLESS = [
    ("llama-headless", lambda: T.LlamaModel(CASES[0].build().config)),
    ("mistral-headless", lambda: T.MistralModel(CASES[1].build().config)),
    ("mixtral-headless", lambda: T.MixtralModel(CASES[2].build().config)),
    ("gpt2-headless", lambda: T.GPT2Model(CASES[3].build().config)),
    ("gptj-headless", lambda: T.GPTJModel(CASES[4].build().config)),
    ("codegen-headless", lambda: T.CodeGenModel(CASES[5].build().config)),
    ("gpt-neox-headless", lambda: T.GPTNeoXModel(CASES[6].build().config)),
    ("falcon-headless", lambda: T.FalconModel(CASES[7].build().config)),
    ("bloom-headless", lambda: T.BloomModel(CASES[8].build().config)),
    ("starcoder-headless", lambda: T.GPTBigCodeModel(CASES[9].build().config)),
    ("gemma2-headless", lambda: T.Gemma2Model(CASES[10].build().config)),
    ("mpt-headless", lambda: T.MptModel(CASES[11].build().config)),
]


@pytest.mark.parametrize(("name", "build"), HEADLESS, ids=[h[0] for h in HEADLESS])
def test_headless_round_trip(name: str, build: Callable[[], Any], tmp_path: Any) -> None:
    base = _randomize(build())
    hf_dir = str(tmp_path / "hf")
    base.save_pretrained(hf_dir)
    mdl, yml, _ = hf_to_cs(hf_dir, str(tmp_path / "cs"), name)
    cs = load_cs(mdl)
    assert "model.lm_head.weight" in cs  # synthesized: the CS model is an LM
    if name not in ("gemma2-headless", "mpt-headless"):  # the simulator has no headless class for these
        from ckptconv.engine.simulator.verify import verify

        report = verify(hf_dir, mdl, yml, name, tolerance=1e-5, rtol=1e-3 if "bloom" in name else 0.0)
        assert report["passed"], report["outputs"]
    out_dir, _ = cs_to_hf(mdl, yml, str(tmp_path / "back"), name)
    back, orig = load_dir(out_dir), load_dir(hf_dir)
    for k, v in orig.items():
        assert k in back, k
        torch.testing.assert_close(back[k], v, rtol=0, atol=1e-6 if "gemma2" in name else 0)
    extra = set(back) - set(orig)
    assert not any("lm_head" in k or "embed_out" in k for k in extra), extra
    loaded = type(base).from_pretrained(out_dir).eval()
    ids = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids).last_hidden_state, base(ids).last_hidden_state, rtol=0, atol=1e-5 if "gemma2" in name else 0
        )
