"""Config conversion: the exact key sets of reference §4, assertions, defaults, transformers 4 and 5 configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ckptconv.core.errors import ConfigConversionError
from ckptconv.engine.layouts.api import convert_config, convert_config_dict

LLAMA_HF = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "attention_bias": False,
    "bos_token_id": 1,
}


def to_cs(hf: dict, model: str = "llama", tgt: str = "cs-2.9") -> dict:
    return convert_config_dict(hf, model=model, src_fmt="hf", tgt_fmt=tgt).target["model"]


def to_hf(cs_model: dict, model: str = "llama", src: str = "cs-2.9") -> dict:
    return convert_config_dict({"model": cs_model}, model=model, src_fmt=src, tgt_fmt="hf").target


def test_llama_import_writes_exactly_29_keys_and_export_the_listed_ones() -> None:
    cs = to_cs(LLAMA_HF)
    consts = {
        "position_embedding_type": "rotary",
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
    }
    assert {k: cs[k] for k in consts} == consts
    assert len(cs) == 29
    assert cs["attention_module"] == "multiquery_attention" and cs["extra_attention_params"] == {"num_kv_groups": 2}
    assert cs["rotary_dim"] == 16 and cs["pos_scaling_factor"] == 1.0 and cs["name"] == "llama"
    assert cs["nonlinearity"] == "swiglu" and cs["share_embedding_weights"] is False
    hf = to_hf(cs)
    assert list(hf) == [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "max_position_embeddings",
        "rope_theta",
        "initializer_range",
        "num_attention_heads",
        "intermediate_size",
        "rms_norm_eps",
        "hidden_act",
        "tie_word_embeddings",
        "num_key_value_heads",
        "rope_scaling",
        "model_type",
    ]
    assert {k: hf[k] for k in hf if k in LLAMA_HF} == {k: LLAMA_HF[k] for k in hf if k in LLAMA_HF}


def test_mha_has_no_extra_attention_params() -> None:
    cs = to_cs({**LLAMA_HF, "num_key_value_heads": 4})
    assert cs["attention_module"] == "aiayn_attention" and "extra_attention_params" not in cs
    assert to_hf(cs)["num_key_value_heads"] == 4


def test_mistral_and_mixtral_extras() -> None:
    mistral = to_hf(to_cs({**LLAMA_HF, "model_type": "mistral", "sliding_window": None}, "mistral"), "mistral")
    assert mistral["sliding_window"] is None and mistral["architectures"] == ["MistralForCausalLM"]
    mix = to_cs(
        {
            **LLAMA_HF,
            "model_type": "mixtral",
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.01,
        },
        "mixtral",
    )
    assert mix["moe"] == {"num_experts": 4, "top_k": 2, "load_balancing_loss_coef": 0.01}
    back = to_hf(mix, "mixtral")
    assert back["num_local_experts"] == 4 and "architectures" not in back and back["model_type"] == "mixtral"


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "linear", "factor": 2.0},
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_scaling_round_trip(scaling: dict) -> None:
    cs = to_cs({**LLAMA_HF, "rope_scaling": scaling})
    assert cs["pos_scaling_factor"] == scaling["factor"]
    assert to_hf(cs)["rope_scaling"] == scaling


def test_transformers5_rope_parameters_are_read() -> None:
    hf = {k: v for k, v in LLAMA_HF.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "linear", "factor": 2.0}
    cs = to_cs(hf)
    assert cs["rope_theta"] == 500000.0 and cs["pos_scaling_factor"] == 2.0 and cs["pos_scaling_type"] == "linear"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "tanh"}, "hidden_act='tanh'"),
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"head_dim": 32}, "head_dim=32"),  # the Model Zoo would drop it silently
    ],
)
def test_import_refusals(change: dict, match: str) -> None:
    with pytest.raises(ConfigConversionError, match=match):
        to_cs({**LLAMA_HF, **change})


def test_export_asserts_cs_consts_with_cs_defaults() -> None:
    cs = to_cs(LLAMA_HF)
    with pytest.raises(ConfigConversionError, match="position_embedding_type='learned'"):
        to_hf({k: v for k, v in cs.items() if k != "position_embedding_type"})  # CS default: learned
    with pytest.raises(ConfigConversionError, match="rotary_dim"):
        to_hf({**cs, "rotary_dim": 8})


def test_gpt2_keys() -> None:
    hf = {
        "model_type": "gpt2",
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }
    cs = to_cs(hf, "gpt2")
    assert len(cs) == 16 and cs["filter_size"] == 256 and cs["use_bias_in_output"] is False
    assert cs["share_embedding_weights"] is True and cs["attention_type"] == "scaled_dot_product"
    assert "position_embedding_type" not in cs and "norm_type" not in cs
    back = to_hf(cs, "gpt2")
    assert set(back) == {
        "vocab_size",
        "n_embd",
        "n_head",
        "n_layer",
        "n_positions",
        "activation_function",
        "embd_pdrop",
        "attn_pdrop",
        "resid_pdrop",
        "layer_norm_epsilon",
        "initializer_range",
        "tie_word_embeddings",
        "n_inner",
        "scale_attn_weights",
        "model_type",
    }
    assert back["n_inner"] == 256
    with pytest.raises(ConfigConversionError):
        to_cs({**hf, "scale_attn_by_inverse_layer_idx": True}, "gpt2")


def test_neox_keys_and_rotary_pct() -> None:
    hf = {
        "model_type": "gpt_neox",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "max_position_embeddings": 128,
        "layer_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "use_parallel_residual": True,
        "tie_word_embeddings": False,
    }
    cs = to_cs(hf, "gpt-neox")
    assert len(cs) == 22 and cs["rotary_dim"] == 4 and cs["use_untied_layer_norm"] is True
    assert cs["residual_dropout_rate"] == 0.0 and cs["attention_dropout_rate"] == 0.0
    back = to_hf(cs, "gpt-neox")
    assert back["rotary_pct"] == 0.25 and back["rotary_emb_base"] == 10000 and back["model_type"] == "gpt_neox"
    with pytest.raises(ConfigConversionError, match="rotary_emb_base"):
        to_cs({**hf, "rotary_emb_base": 500}, "gpt-neox")


def test_gptj_and_codegen() -> None:
    hf = {
        "model_type": "gptj",
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "rotary_dim": 8,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "n_inner": None,
        "tie_word_embeddings": False,
    }
    cs = to_cs(hf, "gptj")
    assert len(cs) == 21 and cs["use_bias_in_output"] is True and cs["use_ffn_bias"] is True
    back = to_hf(cs, "gptj")
    assert len(back) == 16 and back["use_bias_in_output"] is True and "rotary" not in back
    assert to_hf({**cs, "position_embedding_type": "rotary"}, "gptj")["rotary"] is True
    cg = to_cs({**hf, "model_type": "codegen"}, "codegen")
    assert cg["name"] == "gptj" and cg["use_bias_in_output"] is True
    assert "use_bias_in_output" not in to_hf(cg, "codegen")
    with pytest.raises(ConfigConversionError, match="4 heads"):
        to_cs({**hf, "n_head": 2}, "codegen")


def test_falcon_variants() -> None:
    base = {
        "model_type": "falcon",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "max_position_embeddings": 128,
        "bias": False,
        "alibi": False,
        "parallel_attn": True,
        "new_decoder_architecture": False,
        "multi_query": True,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    }
    cs = to_cs(base, "falcon")
    assert len(cs) == 27 and cs["extra_attention_params"] == {"num_kv_groups": 1}
    assert cs["use_untied_layer_norm"] is False and cs["attention_module"] == "multiquery_attention"
    back = to_hf(cs, "falcon")
    assert back["multi_query"] is True and back["new_decoder_architecture"] is False
    assert back["num_ln_in_parallel_attn"] is None and back["bias"] is False
    gqa = to_cs({**base, "new_decoder_architecture": True, "num_kv_heads": 2}, "falcon")
    assert gqa["extra_attention_params"] == {"num_kv_groups": 2} and gqa["use_untied_layer_norm"] is True
    back = to_hf(gqa, "falcon")
    assert (
        back["new_decoder_architecture"] is True and back["num_kv_heads"] == 2 and back["num_ln_in_parallel_attn"] == 2
    )
    mha = to_cs({**base, "multi_query": False}, "falcon")
    assert mha["extra_attention_params"] == {"num_kv_groups": 4}
    legacy = {
        "model_type": "RefinedWebModel",
        "vocab_size": 256,
        "hidden_size": 64,
        "n_layer": 2,
        "n_head": 4,
        "multi_query": True,
        "bias": False,
        "alibi": False,
        "parallel_attn": True,
    }
    cs7 = to_cs(legacy, "falcon")
    assert (
        cs7["num_heads"] == 4 and cs7["num_hidden_layers"] == 2 and cs7["extra_attention_params"]["num_kv_groups"] == 1
    )
    with pytest.raises(ConfigConversionError, match="alibi"):
        to_cs({**base, "alibi": True}, "falcon")


def test_bloom_bert_t5_key_counts() -> None:
    bloom = {
        "model_type": "bloom",
        "vocab_size": 256,
        "hidden_size": 64,
        "n_layer": 2,
        "n_head": 4,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "apply_residual_connection_post_layernorm": False,
        "tie_word_embeddings": True,
    }
    cs = to_cs(bloom, "bloom")
    assert len(cs) == 18 and "max_position_embeddings" not in cs
    assert set(to_hf(cs, "bloom")) == {
        "attention_dropout",
        "hidden_dropout",
        "hidden_size",
        "initializer_range",
        "layer_norm_epsilon",
        "n_head",
        "n_layer",
        "tie_word_embeddings",
        "vocab_size",
        "model_type",
    }
    bert = {
        "model_type": "bert",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 128,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }
    cs = to_cs(bert, "bert")
    assert len(cs) == 17 and cs["pooler_nonlinearity"] == "tanh" and cs["mlm_nonlinearity"] == "gelu"
    with pytest.raises(ConfigConversionError, match="type_vocab_size"):
        to_cs({**bert, "type_vocab_size": 3}, "bert")
    t5 = {
        "model_type": "t5",
        "vocab_size": 256,
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "dropout_rate": 0.1,
        "layer_norm_epsilon": 1e-6,
        "feed_forward_proj": "gated-gelu",
        "is_encoder_decoder": True,
        "tie_word_embeddings": False,
    }
    cs = to_cs(t5, "t5")
    assert len(cs) == 17 and cs["encoder_nonlinearity"] == cs["decoder_nonlinearity"] == "geglu"
    back = to_hf(cs, "t5")
    assert set(back) == {
        "d_ff",
        "d_kv",
        "d_model",
        "num_layers",
        "num_decoder_layers",
        "num_heads",
        "dropout_rate",
        "feed_forward_proj",
        "layer_norm_epsilon",
        "relative_attention_num_buckets",
        "tie_word_embeddings",
        "vocab_size",
        "model_type",
    }
    assert back["feed_forward_proj"] == "gated-gelu" and back["tie_word_embeddings"] is False
    # transformers 5 writes tie_word_embeddings: true and says "untied" with scale_decoder_outputs: false
    assert (
        to_cs({**t5, "tie_word_embeddings": True, "scale_decoder_outputs": False}, "t5")["share_embedding_weights"]
        is False
    )


def test_sequence_classifier_head_config() -> None:
    hf = {
        "model_type": "bert",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "num_labels": 3,
        "classifier_dropout": 0.2,
    }
    cs = to_cs(hf, "bert-sequence-classifier")
    assert cs["num_labels"] == 3 and cs["task_dropout"] == 0.2 and cs["problem_type"] == "single_label_classification"
    tok = to_cs(hf, "bert-token-classifier")
    assert tok["num_classes"] == 3 and tok["encoder_output_dropout_rate"] == 0.2 and tok["loss_weight"] == 1.0
    with pytest.raises(ConfigConversionError, match="num_labels=3"):
        to_cs(hf, "bert-q&a")


def test_release_dependent_import_keys() -> None:
    hf = {**LLAMA_HF, "use_bfloat16": True}
    assert "name" not in to_cs(hf, tgt="cs-2.3") and to_cs(hf, tgt="cs-2.3")["fp16_type"] == "bfloat16"
    assert to_cs(hf, tgt="cs-2.4")["name"] == "llama" and "fp16_type" not in to_cs(hf, tgt="cs-2.4")
    assert to_hf({**to_cs(LLAMA_HF), "fp16_type": "cbfloat16"})["use_bfloat16"] is True


def test_trainer_layout_is_read_on_export() -> None:
    cs = to_cs(LLAMA_HF)
    doc = {"trainer": {"init": {"model": cs, "optimizer": {"AdamW": {"lr": 1e-4}}}}}
    hf = convert_config_dict(doc, model="llama", src_fmt="cs-2.9", tgt_fmt="hf").target
    assert hf["num_key_value_heads"] == 2
    with pytest.raises(ConfigConversionError, match="list of trainers"):
        convert_config_dict({"trainer": [doc["trainer"]]}, model="llama", src_fmt="cs-2.9", tgt_fmt="hf")


def test_convert_config_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_HF))
    out = convert_config(str(tmp_path / "config.json"), model="llama", src_fmt="hf", tgt_fmt="cs-current")
    assert out["path"].endswith("config_to_cs-2.9.yaml")
    text = Path(out["path"]).read_text()
    assert text.startswith("model:\n    ") and list(yaml.safe_load(text)) == ["model"]
    keys = list(yaml.safe_load(text)["model"])
    assert keys == sorted(keys)  # the Model Zoo writes keys sorted, indent 4
    (tmp_path / "params.yaml").write_text(text)
    back = convert_config(str(tmp_path / "params.yaml"), model="llama", src_fmt="cs-2.9", tgt_fmt="hf")
    assert back["path"].endswith("params_to_hf.json")  # one extension stripped
    assert json.loads(Path(back["path"]).read_text())["num_key_value_heads"] == 2
    assert "attention_bias" in out["ignored_keys"]  # HF keys without a rule are reported, not converted
