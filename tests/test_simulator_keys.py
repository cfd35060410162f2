"""For every family, the simulator's Cerebras model has exactly the state-dict keys and shapes that
model-conversions.md §3 gives for a CS >= 2.1 checkpoint of that family.

The CS configs below are what the HF -> CS config import writes (§4), with tiny dimensions; the
expected key lists are transcribed from the §3 tables. Nothing here converts weights.
"""

from __future__ import annotations

import pytest
import torch

from ckptconv.core.errors import SimulationError, UnknownModel
from ckptconv.engine.simulator.config import parse_model_config
from ckptconv.engine.simulator.models import build_model

V, H, NH, D, L, F, P, KV, E = 64, 32, 4, 8, 2, 48, 32, 2, 4

LLAMA = {
    "vocab_size": V,
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_heads": NH,
    "filter_size": F,
    "max_position_embeddings": P,
    "position_embedding_type": "rotary",
    "rotary_dim": D,
    "embedding_dropout_rate": 0.0,
    "embedding_layer_norm": False,
    "attention_type": "scaled_dot_product",
    "use_projection_bias_in_attention": False,
    "use_ffn_bias_in_attention": False,
    "use_ffn_bias": False,
    "attention_dropout_rate": 0.0,
    "dropout_rate": 0.0,
    "use_bias_in_output": False,
    "norm_first": True,
    "use_ff_layer1_dropout": False,
    "norm_type": "rmsnorm",
    "nonlinearity": "swiglu",
    "layer_norm_epsilon": 1e-6,
    "share_embedding_weights": False,
    "attention_module": "multiquery_attention",
    "extra_attention_params": {"num_kv_groups": KV},
    "pos_scaling_factor": 1.0,
    "rope_theta": 10000.0,
}
GPT2 = {
    "vocab_size": V,
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_heads": NH,
    "max_position_embeddings": P,
    "filter_size": F,
    "nonlinearity": "gelu_new",
    "embedding_dropout_rate": 0.1,
    "attention_dropout_rate": 0.1,
    "dropout_rate": 0.1,
    "share_embedding_weights": True,
    "attention_type": "scaled_dot_product",
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "use_bias_in_output": False,
}
GPTJ = {
    "vocab_size": V,
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_heads": NH,
    "max_position_embeddings": P,
    "filter_size": F,
    "rotary_dim": 4,
    "nonlinearity": "gelu_new",
    "use_projection_bias_in_attention": False,
    "use_ffn_bias_in_attention": False,
    "use_ffn_bias": True,
    "use_untied_layer_norm": False,
    "attention_type": "scaled_dot_product",
    "use_bias_in_output": True,
    "share_embedding_weights": False,
}
NEOX = {
    "vocab_size": V,
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_heads": NH,
    "max_position_embeddings": P,
    "filter_size": F,
    "rotary_dim": 2,
    "nonlinearity": "gelu",
    "attention_type": "scaled_dot_product",
    "use_untied_layer_norm": True,
    "use_projection_bias_in_attention": True,
    "use_ffn_bias_in_attention": True,
    "use_ffn_bias": True,
    "use_bias_in_output": False,
    "embedding_dropout_rate": 0.0,
    "share_embedding_weights": False,
}
FALCON = {
    "vocab_size": V,
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_heads": NH,
    "max_position_embeddings": P,
    "filter_size": 4 * H,
    "rotary_dim": D,
    "use_untied_layer_norm": False,
    "attention_module": "multiquery_attention",
    "extra_attention_params": {"num_kv_groups": 1},
    "attention_type": "scaled_dot_product",
    "nonlinearity": "gelu",
    "embedding_dropout_rate": 0.0,
    "use_bias_in_output": False,
    "position_embedding_type": "rotary",
    "use_projection_bias_in_attention": False,
    "use_ffn_bias_in_attention": False,
    "use_ffn_bias": False,
    "share_embedding_weights": True,
}
BLOOM = {
    "vocab_size": V,
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_heads": NH,
    "filter_size": 4 * H,
    "position_embedding_type": "alibi",
    "use_projection_bias_in_attention": True,
    "use_ffn_bias_in_attention": True,
    "use_ffn_bias": True,
    "use_bias_in_output": False,
    "attention_type": "scaled_dot_product",
    "embedding_layer_norm": True,
    "share_embedding_weights": True,
}
STARCODER = {
    **GPT2,
    "position_embedding_type": "learned",
    "use_projection_bias_in_attention": True,
    "use_ffn_bias_in_attention": True,
    "use_ffn_bias": True,
    "attention_module": "multiquery_attention",
    "extra_attention_params": {"num_kv_groups": 1},
    "attention_softmax_fp32": True,
    "loss_scaling": "num_tokens",
}
BTLM = {
    **GPT2,
    "position_embedding_type": "alibi",
    "nonlinearity": "swiglu",
    "embeddings_scale": 14.6,
    "output_logits_scale": 0.22,
    "scale_qk_dot_by_d": True,
}
GEMMA2 = {
    **LLAMA,
    "nonlinearity": "geglu",
    "attention_inner_dim": NH * 16,
    "rotary_dim": 16,
    "embeddings_scale": H**0.5,
    "norm_first_sandwich": True,
    "sliding_window_every_other_decoder_layer": True,
    "attention_sliding_window_length": 8,
    "attention_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "share_embedding_weights": True,
}
BERT = {
    "vocab_size": V,
    "hidden_size": H,
    "num_hidden_layers": L,
    "num_heads": NH,
    "filter_size": F,
    "max_position_embeddings": P,
    "encoder_nonlinearity": "gelu",
    "dropout_rate": 0.1,
    "attention_dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-12,
    "initializer_range": 0.02,
    "share_embedding_weights": True,
    "position_embedding_type": "learned",
    "pooler_nonlinearity": "tanh",
    "mlm_nonlinearity": "gelu",
    "freeze_ffn_bias_in_glu": False,
}
ROBERTA = {
    **BERT,
    "max_position_embeddings": P - 2,
    "pad_token_id": 1,
    "num_segments": 1,
    "mask_padding_in_positional_embed": True,
    "disable_nsp": True,
    "mlm_nonlinearity": "gelu",
}
T5 = {
    "src_vocab_size": V,
    "d_model": H,
    "d_kv": D,
    "d_ff": F,
    "encoder_num_hidden_layers": L,
    "decoder_num_hidden_layers": L,
    "num_heads": NH,
    "relative_attention_num_buckets": 8,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "encoder_nonlinearity": "relu",
    "decoder_nonlinearity": "relu",
    "share_embedding_weights": True,
    "norm_type": "rmsnorm",
    "src_max_position_embeddings": 512,
    "tgt_max_position_embeddings": 512,
}


def _linear(out: dict, key: str, o: int, i: int, bias: bool) -> None:
    out[f"{key}.weight"] = (o, i)
    if bias:
        out[f"{key}.bias"] = (o,)


def _norm(out: dict, key: str, dim: int, bias: bool) -> None:
    out[f"{key}.weight"] = (dim,)
    if bias:
        out[f"{key}.bias"] = (dim,)


def decoder_keys(
    *,
    q: int = H,
    kv: int = H,
    attn_bias: bool,
    ffn_bias: bool,
    norm_bias: bool,
    glu: bool = False,
    norm3: bool = True,
    sandwich: bool = False,
    learned_positions: bool = False,
    alibi: bool = False,
    embedding_ln: bool = False,
    lm_bias: bool = False,
    experts: int = 0,
    filter_size: int = F,
) -> dict[str, tuple[int, ...]]:
    """§3.0: the CS vocabulary for decoder LMs."""
    out: dict[str, tuple[int, ...]] = {"embedding_layer.word_embeddings.weight": (V, H)}
    if learned_positions:
        out["embedding_layer.position_embeddings.embed.weight"] = (P, H)
    if alibi:
        out["embedding_layer.position_embed_helper.slopes"] = (NH, 1)
    if embedding_ln:
        _norm(out, "embedding_ln_f", H, True)
    for i in range(L):
        p = f"transformer_decoder.layers.{i}."
        _linear(out, p + "self_attn.proj_q_dense_layer", q, H, attn_bias)
        _linear(out, p + "self_attn.proj_k_dense_layer", kv, H, attn_bias)
        _linear(out, p + "self_attn.proj_v_dense_layer", kv, H, attn_bias)
        _linear(out, p + "self_attn.proj_output_dense_layer", H, q, attn_bias)
        _norm(out, p + "norm1", H, norm_bias)
        if norm3:
            _norm(out, p + "norm3", H, norm_bias)
        if sandwich:
            _norm(out, p + "norm1_post", H, norm_bias)
            _norm(out, p + "norm3_post", H, norm_bias)
        if experts:
            out[p + "ffn.gate.weight"] = (experts, H)
            out[p + "ffn.experts.fused_ffns.0.linear_layer.expert_weights"] = (F, experts, H)
            out[p + "ffn.experts.fused_ffns.0.linear_layer_for_glu.expert_weights"] = (F, experts, H)
            out[p + "ffn.experts.fused_ffns.1.linear_layer.expert_weights"] = (H, experts, F)
        else:
            _linear(out, p + "ffn.ffn.0.linear_layer", filter_size, H, ffn_bias)
            if glu:
                _linear(out, p + "ffn.ffn.0.linear_layer_for_glu", filter_size, H, ffn_bias)
            _linear(out, p + "ffn.ffn.1.linear_layer", H, filter_size, ffn_bias)
    _norm(out, "transformer_decoder.norm", H, norm_bias)
    _norm(out, "ln_f", H, norm_bias)
    _linear(out, "lm_head", V, H, lm_bias)
    return out


def bert_encoder_keys(prefix: str, *, segments: int, positions: int, pooler: bool) -> dict[str, tuple[int, ...]]:
    """§3.12: the CS BERT encoder under ``prefix``."""
    out: dict[str, tuple[int, ...]] = {
        prefix + "embedding_layer.word_embeddings.weight": (V, H),
        prefix + "embedding_layer.position_embeddings.embed.weight": (positions, H),
    }
    if segments:
        out[prefix + "embedding_layer.segment_embeddings.weight"] = (segments, H)
    _norm(out, prefix + "embed_ln_f", H, True)
    for i in range(L):
        p = f"{prefix}transformer_encoder.layers.{i}."
        for n in ("q", "k", "v", "output"):
            _linear(out, f"{p}self_attn.proj_{n}_dense_layer", H, H, True)
        _norm(out, p + "norm1", H, True)
        _linear(out, p + "ffn.ffn.0.linear_layer", F, H, True)
        _linear(out, p + "ffn.ffn.1.linear_layer", H, F, True)
        _norm(out, p + "norm2", H, True)
    if pooler:
        _linear(out, prefix + "pooler.pooler.ffn.0.linear_layer", H, H, True)
    return out


def mlm_keys(nsp: bool) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    _linear(out, "bert_mlm_head.mlm_transform.ffn.ffn.0.linear_layer", H, H, True)
    _norm(out, "bert_mlm_head.mlm_transform.ln", H, True)
    _linear(out, "bert_mlm_head.classifier.ffn.0.linear_layer", V, H, True)
    if nsp:
        _linear(out, "bert_cls_head.classifier.ffn.0.linear_layer", 2, H, True)
    return out


def t5_keys() -> dict[str, tuple[int, ...]]:
    """§3.14."""
    inner = NH * D
    out: dict[str, tuple[int, ...]] = {
        "encoder_embeddings.word_embeddings.weight": (V, H),
        "decoder_embeddings.word_embeddings.weight": (V, H),
        "encoder_embeddings.position_embed_helper.relative_attention_bias.weight": (8, NH),
        "decoder_embeddings.position_embed_helper.relative_attention_bias.weight": (8, NH),
        "encoder.norm.weight": (H,),
        "decoder.norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    for stack in ("encoder", "decoder"):
        for i in range(L):
            p = f"{stack}.layers.{i}."
            attns = ["self_attn"] + (["multihead_attn"] if stack == "decoder" else [])
            for a in attns:
                for n in ("q", "k", "v"):
                    out[f"{p}{a}.proj_{n}_dense_layer.weight"] = (inner, H)
                out[f"{p}{a}.proj_output_dense_layer.weight"] = (H, inner)
            for n in ("norm1", "norm2") + (("norm3",) if stack == "decoder" else ()):
                out[f"{p}{n}.weight"] = (H,)
            out[p + "ffn.ffn.0.linear_layer.weight"] = (F, H)
            out[p + "ffn.ffn.1.linear_layer.weight"] = (H, F)
    return out


GQA = {"q": H, "kv": KV * D}
CASES = {
    "gpt2": (GPT2, decoder_keys(attn_bias=True, ffn_bias=True, norm_bias=True, learned_positions=True)),
    "llama": (LLAMA, decoder_keys(**GQA, attn_bias=False, ffn_bias=False, norm_bias=False, glu=True)),
    "mistral": (
        {**LLAMA, "attention_sliding_window_length": 8},
        decoder_keys(**GQA, attn_bias=False, ffn_bias=False, norm_bias=False, glu=True),
    ),
    "mixtral": (
        {**LLAMA, "moe": {"num_experts": E, "top_k": 2, "load_balancing_loss_coef": 0.02}},
        decoder_keys(**GQA, attn_bias=False, ffn_bias=False, norm_bias=False, glu=True, experts=E),
    ),
    "gptj": (GPTJ, decoder_keys(attn_bias=False, ffn_bias=True, norm_bias=True, norm3=False, lm_bias=True)),
    "codegen": (GPTJ, decoder_keys(attn_bias=False, ffn_bias=True, norm_bias=True, norm3=False, lm_bias=True)),
    "gpt-neox": (NEOX, decoder_keys(attn_bias=True, ffn_bias=True, norm_bias=True)),
    "falcon": (
        FALCON,
        decoder_keys(q=H, kv=D, attn_bias=False, ffn_bias=False, norm_bias=True, norm3=False, filter_size=4 * H),
    ),
    "bloom": (
        BLOOM,
        decoder_keys(attn_bias=True, ffn_bias=True, norm_bias=True, alibi=True, embedding_ln=True, filter_size=4 * H),
    ),
    "starcoder": (
        STARCODER,
        decoder_keys(q=H, kv=D, attn_bias=True, ffn_bias=True, norm_bias=True, learned_positions=True),
    ),
    "santacoder": (
        STARCODER,
        decoder_keys(q=H, kv=D, attn_bias=True, ffn_bias=True, norm_bias=True, learned_positions=True),
    ),
    "btlm": (BTLM, decoder_keys(attn_bias=True, ffn_bias=True, norm_bias=True, glu=True, alibi=True)),
    "jais": (BTLM, decoder_keys(attn_bias=True, ffn_bias=True, norm_bias=True, glu=True, alibi=True)),
    "gemma2": (
        GEMMA2,
        decoder_keys(q=NH * 16, kv=KV * 16, attn_bias=False, ffn_bias=False, norm_bias=False, glu=True, sandwich=True),
    ),
    "bert": (
        BERT,
        {**bert_encoder_keys("bert_encoder.", segments=2, positions=P, pooler=True), **mlm_keys(nsp=True)},
    ),
    "roberta": (
        ROBERTA,
        {**bert_encoder_keys("bert_encoder.", segments=1, positions=P, pooler=False), **mlm_keys(nsp=False)},
    ),
    "bert-sequence-classifier": (
        {**BERT, "num_labels": 3, "problem_type": "single_label_classification"},
        {
            **bert_encoder_keys("bert.", segments=2, positions=P, pooler=True),
            "classifier.weight": (3, H),
            "classifier.bias": (3,),
        },
    ),
    "bert-token-classifier": (
        {**BERT, "num_classes": 5},
        {
            **bert_encoder_keys("bert.", segments=2, positions=P, pooler=False),
            "classifier.weight": (5, H),
            "classifier.bias": (5,),
        },
    ),
    "bert-qa": (
        BERT,
        {
            **bert_encoder_keys("bert.", segments=2, positions=P, pooler=False),
            "classifier.weight": (2, H),
            "classifier.bias": (2,),
        },
    ),
    "t5": (T5, t5_keys()),
}


@pytest.mark.parametrize("model", sorted(CASES))
def test_state_dict_keys_and_shapes_match_the_reference(model: str) -> None:
    section, expected = CASES[model]
    cs = parse_model_config({"model": {**section, "name": model}})
    got = {k: tuple(v.shape) for k, v in build_model(cs).state_dict().items()}
    assert sorted(set(got) - set(expected)) == []
    assert sorted(set(expected) - set(got)) == []
    assert got == expected


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert", "t5"])
def test_empty_materialisation_has_the_same_keys_and_ties(model: str) -> None:
    section, expected = CASES[model]
    cs = parse_model_config({"model": {**section, "name": model}})
    m = build_model(cs, materialize="empty")
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == expected
    sd = m.state_dict(keep_vars=True)
    if model == "gpt2":
        assert sd["lm_head.weight"] is sd["embedding_layer.word_embeddings.weight"]
        assert sd["ln_f.weight"] is sd["transformer_decoder.norm.weight"]
    if model == "t5":
        assert sd["decoder_embeddings.word_embeddings.weight"] is sd["encoder_embeddings.word_embeddings.weight"]
        assert sd["lm_head.weight"] is sd["encoder_embeddings.word_embeddings.weight"]
    if model == "bert":
        assert (
            sd["bert_mlm_head.classifier.ffn.0.linear_layer.weight"]
            is sd["bert_encoder.embedding_layer.word_embeddings.weight"]
        )


@pytest.mark.parametrize("model", sorted(CASES))
def test_every_family_runs_forward_and_backward(model: str) -> None:
    section, _ = CASES[model]
    cs = parse_model_config({"model": {**section, "name": model}})
    m = build_model(cs).train()
    ids = torch.randint(0, V, (2, 8))
    if cs.class_name == "T5ForConditionalGeneration":
        out = m(ids, ids)
    elif cs.class_name in ("GPT2LMHeadModel", "GPTJModel"):
        out = m(ids)
    else:
        out = torch.cat([v.flatten() for v in m(ids, torch.zeros_like(ids)).values()])
    assert torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_cs_model_class_defaults_fill_a_sparse_gpt2_config() -> None:
    # The converted GPT-2 YAML relies on GPT2LMHeadModel defaults: learned positions, layer norm, biases.
    cs = parse_model_config({"model": {"name": "gpt2", "vocab_size": V, "hidden_size": H, "num_heads": NH}})
    p = cs.params
    assert p["position_embedding_type"] == "learned"
    assert p["norm_type"] == "layernorm"
    assert p["use_projection_bias_in_attention"] and p["use_ffn_bias_in_attention"] and p["use_ffn_bias"]
    assert p["embedding_dropout_rate"] == p["dropout_rate"] == 0.1
    assert p["num_hidden_layers"] == 12 and p["filter_size"] == 3072 and p["max_position_embeddings"] == 1024


def test_gptj_class_defaults_differ_from_gpt2() -> None:
    p = parse_model_config({"model": {"name": "gpt-neox", "hidden_size": 64, "num_heads": 4}}).params
    assert p["position_embedding_type"] == "rotary"
    assert p["rotary_dim"] == 4  # int(head_dim * 0.25)
    assert p["use_ffn_bias"] is False and p["use_untied_layer_norm"] is False
    assert p["embedding_dropout_rate"] == 0.1


def test_trainer_layout_and_aliases() -> None:
    doc = {"trainer": {"init": {"model": {"name": "gpt-neox", "residual_dropout_rate": 0.0, "embd_pdrop": 0.0}}}}
    p = parse_model_config(doc).params
    assert p["dropout_rate"] == 0.0 and p["embedding_dropout_rate"] == 0.0


def test_refusals() -> None:
    with pytest.raises(UnknownModel):
        parse_model_config({"model": {"name": "no-such-model"}})
    with pytest.raises(SimulationError, match="fixed_sparse_attention"):
        parse_model_config({"model": {**GPT2, "name": "gpt2", "fixed_sparse_attention": {"x": 1}}})
    with pytest.raises(SimulationError, match="gelu_pytorch_tanh"):
        build_model(parse_model_config({"model": {**GPT2, "name": "starcoder", "nonlinearity": "gelu_pytorch_tanh"}}))
    cs = parse_model_config({"model": {**GPT2, "name": "gpt2", "some_wrapper_option": 1}})
    assert cs.ignored == ("some_wrapper_option",)
