"""Tiny random Hugging Face models, converted to Cerebras by the model-layout converter, give the
simulator's Cerebras model the logits ``transformers`` computes (fp32, 1e-5) — family by family.

The conversion always goes through ``ckptconv.engine.layouts.api.convert_model`` (never a converter written
here); a family the layout registry does not know yet is skipped with that reason. Deliberately
wrong checkpoints (unpermuted rotary q/k, extra and missing keys) show that verify and strict
loading catch what they should.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from ckptconv.cli import main as cli_main
from ckptconv.core.errors import CheckpointMismatch, SimulationError, UnknownModel
from ckptconv.engine.simulator.checkpoint_io import open_checkpoint, read_checkpoint, write_checkpoint
from ckptconv.engine.simulator.verify import verify

TINY_DECODER = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
LLAMA_LIKE = dict(**TINY_DECODER, hidden_size=64, intermediate_size=96, num_key_value_heads=2)
GPT2_LIKE = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
BERT_LIKE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)

# model -> (transformers config class, model class, config kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_LIKE),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA_LIKE, "sliding_window": 8}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT2_LIKE),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {**GPT2_LIKE, "rotary_dim": 4}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", {**GPT2_LIKE, "rotary_dim": 4, "n_ctx": 64}),
    "gpt-neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {**TINY_DECODER, "hidden_size": 64, "intermediate_size": 128, "rotary_pct": 0.25},
    ),
    "falcon": ("FalconConfig", "FalconForCausalLM", {**TINY_DECODER, "hidden_size": 64}),
    # HF GPTBigCode defaults to gelu_pytorch_tanh, a name the Model Zoo does not accept (see below).
    "starcoder": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**GPT2_LIKE, "activation_function": "gelu_new"}),
    # An exact-GELU Gemma 2 (the Model Zoo's geglu is exact), sequence within the sliding window.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 32, "query_pre_attn_scalar": 12, "hidden_activation": "gelu"},
    ),
    "bert": ("BertConfig", "BertForPreTraining", {**BERT_LIKE, "max_position_embeddings": 64}),
    "roberta": (
        "RobertaConfig",
        "RobertaForMaskedLM",
        {**BERT_LIKE, "max_position_embeddings": 66, "pad_token_id": 1, "type_vocab_size": 1},
    ),
    "bert-sequence-classifier": (
        "BertConfig",
        "BertForSequenceClassification",
        {**BERT_LIKE, "max_position_embeddings": 64, "num_labels": 3},
    ),
    "bert-token-classifier": (
        "BertConfig",
        "BertForTokenClassification",
        {**BERT_LIKE, "max_position_embeddings": 64, "num_labels": 5},
    ),
    "bert-qa": ("BertConfig", "BertForQuestionAnswering", {**BERT_LIKE, "max_position_embeddings": 64}),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            vocab_size=128,
            d_model=64,
            d_kv=16,
            d_ff=96,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="relu",
        ),
    ),
}


# Families whose converted model cannot match transformers at 1e-5, for reasons shown in their tests.
KNOWN_DIFFERENCES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bloom": ("BloomConfig", "BloomForCausalLM", {"vocab_size": 128, "hidden_size": 64, "n_layer": 2, "n_head": 4}),
}
HF_MODELS = {**FAMILIES, **KNOWN_DIFFERENCES}


def _require_layout(model: str) -> None:
    from ckptconv.engine.layouts.registry import resolve

    try:
        resolve(model)
    except UnknownModel:
        pytest.skip(f"the model-layout converter has no table for {model!r} yet")


def _noisy(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Move every parameter off its init (norm weights away from 1, biases away from 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def make_hf(root: Path, model: str, *, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    config_cls, model_cls, kwargs = HF_MODELS[model]
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    hf = _noisy(getattr(transformers, model_cls)(hf_config)).to(dtype)
    out = root / "hf"
    hf.save_pretrained(out)
    return out


def convert(hf_dir: Path, out: Path, model: str) -> tuple[str, str]:
    """HF -> cs-2.9 through the model-layout converter; returns (checkpoint, config) paths."""
    from ckptconv.engine.layouts.api import convert_model

    result = convert_model(str(hf_dir), str(out), model=model, src_fmt="hf", tgt_fmt="cs-2.9")
    mdl = [o.uri for o in result.outputs if o.uri.endswith(".mdl")]
    yaml_ = [o.uri for o in result.outputs if o.uri.endswith(".yaml")]
    assert len(mdl) == 1 and len(yaml_) == 1, result.outputs
    return mdl[0], yaml_[0]


@functools.cache
def converted(model: str, root: str) -> tuple[str, str, str]:
    base = Path(root) / model
    hf_dir = make_hf(base, model)
    mdl, cfg = convert(hf_dir, base / "cs", model)
    return str(hf_dir), mdl, cfg


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("verify"))


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_converted_tiny_model_matches_transformers(model: str, workdir: str) -> None:
    _require_layout(model)
    hf_dir, mdl, cfg = converted(model, workdir)
    result = verify(hf_dir, mdl, cfg, model)
    assert result["load"]["missing"] == [] and result["load"]["unexpected"] == []
    assert result["passed"], result["outputs"]
    assert result["max_abs_diff"] <= 1e-5
    assert result["cosine_similarity"] > 0.999999
    assert result["outputs"]


def test_unpermuted_rotary_is_caught(workdir: str, tmp_path: Path) -> None:
    """A llama conversion that copies q/k without the rotate-half -> interleaved permutation fails."""
    _require_layout("llama")
    hf_dir, mdl, cfg = converted("llama", workdir)
    hf_sd = transformers.LlamaForCausalLM.from_pretrained(hf_dir).state_dict()
    src = open_checkpoint(mdl)
    ckpt = read_checkpoint(src)
    src.close()
    for i in range(2):
        for n in ("q", "k"):
            ckpt["model"][f"transformer_decoder.layers.{i}.self_attn.proj_{n}_dense_layer.weight"] = hf_sd[
                f"model.layers.{i}.self_attn.{n}_proj.weight"
            ].clone()
    wrong = str(tmp_path / "unpermuted.mdl")
    write_checkpoint(wrong, ckpt, cstorch_version="2.9.0")
    good = verify(hf_dir, mdl, cfg, "llama")
    bad = verify(hf_dir, wrong, cfg, "llama")
    assert good["passed"]
    assert not bad["passed"] and bad["verdict"] == "fail"
    assert bad["max_abs_diff"] > 1e-3
    assert bad["cosine_similarity"] < good["cosine_similarity"]
    assert cli_main(["verify", "--hf", hf_dir, "--cs", wrong, "--cs-config", cfg, "--model", "llama"]) == 1
    assert cli_main(["verify", "--hf", hf_dir, "--cs", mdl, "--cs-config", cfg, "--model", "llama"]) == 0


def _rewrite(mdl: str, out: str, edit) -> str:
    src = open_checkpoint(mdl)
    ckpt = read_checkpoint(src)
    src.close()
    edit(ckpt["model"])
    write_checkpoint(out, ckpt, cstorch_version="2.9.0")
    return out


def test_strict_loading_names_unexpected_and_missing_keys(workdir: str, tmp_path: Path) -> None:
    _require_layout("llama")
    hf_dir, mdl, cfg = converted("llama", workdir)
    extra = _rewrite(mdl, str(tmp_path / "extra.mdl"), lambda m: m.__setitem__("extra_head.weight", torch.ones(3)))
    with pytest.raises(CheckpointMismatch, match=r"extra_head\.weight") as err:
        verify(hf_dir, extra, cfg, "llama")
    assert err.value.details["unexpected"] == ["extra_head.weight"]
    assert err.value.details["missing"] == []
    lenient = verify(hf_dir, extra, cfg, "llama", strict=False)
    assert lenient["passed"] and lenient["load"]["unexpected"] == ["extra_head.weight"]

    missing = _rewrite(mdl, str(tmp_path / "missing.mdl"), lambda m: m.pop("ln_f.weight"))
    with pytest.raises(CheckpointMismatch, match=r"ln_f\.weight") as err:
        verify(hf_dir, missing, cfg, "llama")
    assert err.value.details["missing"] == ["ln_f.weight"]
    assert "transformer_decoder.norm.weight" in str(err.value)  # the tie partner is named
    lenient = verify(hf_dir, missing, cfg, "llama", strict=False)
    assert lenient["passed"]  # ln_f is the same module as transformer_decoder.norm, which was loaded
    assert lenient["load"]["missing"] == ["ln_f.weight"]

    def bad_shape(m: dict) -> None:
        m["lm_head.weight"] = torch.zeros(7, 64)

    wrong = _rewrite(mdl, str(tmp_path / "shape.mdl"), bad_shape)
    for strict in (True, False):
        with pytest.raises(CheckpointMismatch, match="wrong shape"):
            verify(hf_dir, wrong, cfg, "llama", strict=strict)


def test_bf16_checkpoint_is_compared_after_upcasting(tmp_path: Path) -> None:
    _require_layout("llama")
    hf_dir = make_hf(tmp_path, "llama", dtype=torch.bfloat16)
    mdl, cfg = convert(hf_dir, tmp_path / "cs", "llama")
    result = verify(str(hf_dir), mdl, cfg, "llama")
    assert set(result["checkpoint_dtypes"]) == {"bfloat16"}
    assert result["dtype"] == "float32"
    assert result["passed"], result["outputs"]


def test_headless_model_compares_hidden_states(tmp_path: Path) -> None:
    _require_layout("llama-headless")
    torch.manual_seed(0)
    hf = _noisy(transformers.LlamaModel(transformers.LlamaConfig(**LLAMA_LIKE)))
    hf.save_pretrained(tmp_path / "hf")
    mdl, cfg = convert(tmp_path / "hf", tmp_path / "cs", "llama-headless")
    result = verify(str(tmp_path / "hf"), mdl, cfg, "llama-headless")
    assert list(result["outputs"]) == ["hidden_states"]
    assert result["passed"], result["outputs"]


def test_bloom_differs_by_the_gelu_approximation(workdir: str) -> None:
    """HF BLOOM hard-codes the tanh GELU; the converted CS config says `gelu`, which the Model Zoo
    computes exactly. The simulator keeps the Model Zoo's arithmetic, so the difference shows."""
    _require_layout("bloom")
    hf_dir, mdl, cfg = converted("bloom", workdir)
    result = verify(hf_dir, mdl, cfg, "bloom")
    assert result["load"]["missing"] == [] and result["load"]["unexpected"] == []
    assert not result["passed"]
    assert 1e-6 < result["max_abs_diff"] < 1e-3
    assert result["cosine_similarity"] > 0.99999


def test_gemma2_tanh_gelu_and_sliding_window_parity(tmp_path: Path) -> None:
    """Two real differences between HF Gemma 2 and the Model Zoo's GPT2LMHeadModel configured as
    Gemma 2: HF's gelu_pytorch_tanh becomes the exact-GELU `geglu`, and the Model Zoo windows the
    odd layers (its "full_attention_first" pattern) where HF windows the even ones."""
    _require_layout("gemma2")
    hf_dir = make_hf(tmp_path / "exact", "gemma2", sliding_window=8)
    mdl, cfg = convert(hf_dir, tmp_path / "exact" / "cs", "gemma2")
    assert verify(str(hf_dir), mdl, cfg, "gemma2", seq_len=8)["passed"]
    long = verify(str(hf_dir), mdl, cfg, "gemma2", seq_len=24)
    assert not long["passed"] and long["max_abs_diff"] > 1e-2

    hf_dir = make_hf(tmp_path / "tanh", "gemma2", hidden_activation="gelu_pytorch_tanh")
    mdl, cfg = convert(hf_dir, tmp_path / "tanh" / "cs", "gemma2")
    tanh = verify(str(hf_dir), mdl, cfg, "gemma2", seq_len=16)
    assert not tanh["passed"] and tanh["max_abs_diff"] < 1e-2


@pytest.mark.parametrize("model", ["santacoder", "btlm", "jais"])
def test_remote_code_families_are_refused_by_verify(model: str, tmp_path: Path) -> None:
    doc = {"model": {"name": model, "vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_hidden_layers": 1}}
    with pytest.raises(SimulationError, match="remote code"):
        verify(str(tmp_path), str(tmp_path / "x.mdl"), doc, model)


def test_everything_on_s3(workdir: str, s3_bucket: str) -> None:
    _require_layout("llama")
    from ckptconv.storage import open_storage

    hf_dir, mdl, cfg = converted("llama", workdir)
    base = f"s3://{s3_bucket}/verify"
    storage = open_storage(base)
    for f in Path(hf_dir).iterdir():
        storage.write_bytes(f"{base}/hf/{f.name}", f.read_bytes())
    storage.write_bytes(f"{base}/cs/model.mdl", Path(mdl).read_bytes())
    storage.write_bytes(f"{base}/cs/config.yaml", Path(cfg).read_bytes())
    result = verify(f"{base}/hf", f"{base}/cs/model.mdl", f"{base}/cs/config.yaml", "llama")
    assert result["passed"], result["outputs"]
    assert result == {
        **verify(hf_dir, mdl, cfg, "llama"),
        "hf_dir": f"{base}/hf",
        "cs_checkpoint": f"{base}/cs/model.mdl",
        "timings": result["timings"],
    }


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(rope_scaling: dict, tmp_path: Path) -> None:
    _require_layout("llama")
    hf_dir = make_hf(tmp_path, "llama", rope_scaling=rope_scaling)
    mdl, cfg = convert(hf_dir, tmp_path / "cs", "llama")
    result = verify(str(hf_dir), mdl, cfg, "llama", seq_len=48)  # past original_max_position_embeddings
    assert result["passed"], result["outputs"]
