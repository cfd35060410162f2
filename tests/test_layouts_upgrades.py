"""Release upgrades: the graph, key renames, config steps, and CS -> CS conversions through files."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from ckptconv.core.errors import DataloaderStateError, NoConversionPath
from ckptconv.core.releases import known_release
from ckptconv.engine.layouts.api import convert_config_dict, convert_model, plan_model
from ckptconv.engine.layouts.registry import families
from ckptconv.engine.layouts.upgrades import find_path, parse_format, rename_key


def test_formats() -> None:
    assert parse_format("cs-current", side="target") == "cs-2.9"
    assert parse_format("cs-2.05", side="source") == "cs-2.5"
    assert parse_format("cs-auto", side="source") == "cs-auto"
    for bad, side in [("cs-auto", "target"), ("cs-current", "source"), ("cs-3.0", "target"), ("tf", "source")]:
        with pytest.raises(NoConversionPath):
            parse_format(bad, side=side)
    assert known_release("2.4.0") == "2.4" and known_release("2.10.0") is None


def test_paths_are_single_passes_through_the_graph() -> None:
    fams = families()
    assert find_path(fams["llama"], "hf", "cs-2.9") == ["hf", "cs-2.9"]
    assert find_path(fams["llama"], "hf", "cs-1.9") == ["hf", "cs-2.1", "cs-2.0", "cs-1.9"]
    assert find_path(fams["gpt2"], "cs-1.9", "hf") == ["cs-1.9", "cs-2.0", "cs-2.1", "hf"]
    # hf is an end of a path, never a shortcut between releases
    assert find_path(fams["gpt2"], "cs-2.0", "cs-2.9") == [
        f"cs-{r}" for r in ("2.0", "2.1", "2.2", "2.3", "2.4", "2.5", "2.6", "2.7", "2.8", "2.9")
    ]
    assert find_path(fams["gptj"], "hf", "cs-2.0") == ["hf", "cs-2.0"]  # GPT-J's HF converter reaches 2.0
    with pytest.raises(NoConversionPath, match=r"mixtral has no cs-2\.2"):
        find_path(fams["mixtral"], "hf", "cs-2.2")


def test_renames_between_2_0_and_2_1() -> None:
    pairs = [
        ("embedding_layer.position_embeddings.weight", "embedding_layer.position_embeddings.embed.weight"),
        ("embedding_layer.position_embeddings", "embedding_layer.position_embeddings.fpe"),
        ("relative_pe_helper.slopes", "embedding_layer.position_embed_helper.slopes"),
        (
            "bert_encoder.embedding_layer.position_embeddings.weight",
            "bert_encoder.embedding_layer.position_embeddings.embed.weight",
        ),
        (
            "relative_position_encoder.relative_attention_bias.weight",
            "encoder_embeddings.position_embed_helper.relative_attention_bias.weight",
        ),
        ("transformer_decoder.layers.0.norm1.weight", "transformer_decoder.layers.0.norm1.weight"),
    ]
    for old, new in pairs:
        assert rename_key(old, "cs-1.9", "cs-2.9") == new
        assert rename_key(new, "cs-2.9", "cs-1.9") == old
        assert rename_key(old, "cs-1.8", "cs-2.0") == old  # no rename below 2.1


LEGACY_GPT2 = {
    "model": {
        "vocab_size": 256,
        "hidden_size": 64,
        "num_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 128,
        "filter_size": 256,
        "nonlinearity": "gelu_new",
        "use_rms_norm": False,
        "share_embedding_weights": True,
        "use_bfloat16": True,
        "precision_opt_level": 1,
    },
    "optimizer": {
        "optimizer_type": "AdamW",
        "beta1": 0.9,
        "beta2": 0.95,
        "weight_decay_rate": 0.01,
        "learning_rate": {"scheduler": "Linear", "initial_learning_rate": 1e-4, "end_learning_rate": 0.0, "steps": 100},
    },
    "runconfig": {
        "max_steps": 100,
        "checkpoint_steps": 50,
        "num_wgt_servers": 2,
        "keep_checkpoint_max": 3,
        "is_pretrained_checkpoint": True,
        "use_cs_grad_accum": False,
    },
    "train_input": {"batch_size": 8},
}


def test_config_chain_up_and_down() -> None:
    up = convert_config_dict(LEGACY_GPT2, model="gpt2", src_fmt="cs-1.9", tgt_fmt="cs-2.9").target
    init = up["trainer"]["init"]
    m = init["model"]
    assert m["norm_type"] == "layernorm" and "use_rms_norm" not in m and m["name"] == "gpt2"
    assert init["precision"]["fp16_type"] == "bfloat16"
    opt = init["optimizer"]["AdamW"]
    assert opt["betas"] == [0.9, 0.95] and opt["weight_decay"] == 0.01
    assert init["schedulers"][0]["total_iters"] == 100
    assert init["loop"]["max_steps"] == 100 and init["checkpoint"] == {"steps": 50}
    assert up["trainer"]["fit"]["train_dataloader"]["micro_batch_size"] is None
    flat = yaml.safe_dump(up)
    assert "num_wgt_servers" not in flat and "keep_checkpoint_max" not in flat and "csconfig" not in flat
    down = convert_config_dict(up, model="gpt2", src_fmt="cs-2.9", tgt_fmt="cs-2.0").target
    assert down["model"]["vocab_size"] == 256 and down["model"]["use_bfloat16"] is True
    assert "trainer" not in down and down["optimizer"]["beta1"] == 0.9


def test_config_muP_rework_2_2_to_2_3() -> None:
    doc = copy.deepcopy(LEGACY_GPT2)
    doc["model"].update(
        output_logits_scale=2.0,
        embeddings_scale=10.0,
        scale_qk_dot_by_d=True,
        initializer={"name": "truncated_normal", "std": 0.02},
        output_layer_initializer={"name": "normal", "std": 0.01},
    )
    doc["optimizer"]["adjust_learning_rate"] = {"decoder_kernel": 0.25}
    m = convert_config_dict(doc, model="gpt2", src_fmt="cs-2.2", tgt_fmt="cs-2.3").target["trainer"]["init"]["model"]
    assert m["mup_base_hidden_size"] == 16.0 and m["mup_base_filter_size"] == 64.0
    assert m["output_logits_alpha"] == 8.0
    assert m["initializer"]["std"] == pytest.approx(0.04) and m["initializer"]["a"] == pytest.approx(-0.08)
    assert m["output_layer_initializer"]["std"] == pytest.approx(0.01 * 2 * 2)


def _gpt2_cs_state(inner: str) -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    emb, norm_w, norm_b = r(256, 64), r(64), r(64)
    model: dict = {
        f"{inner}embedding_layer.word_embeddings.weight": emb,
        f"{inner}embedding_layer.position_embeddings.weight": r(128, 64),
        f"{inner}lm_head.weight": None,  # old cstorch: tied member stored as None
        f"{inner}transformer_decoder.norm.weight": norm_w,
        f"{inner}transformer_decoder.norm.bias": norm_b,
        f"{inner}ln_f.weight": norm_w,
        f"{inner}ln_f.bias": norm_b,
    }  # tied: written as links
    for i in range(2):
        p = f"{inner}transformer_decoder.layers.{i}."
        for n in ("q", "k", "v", "output"):
            model[f"{p}self_attn.proj_{n}_dense_layer.weight"] = r(64, 64)
            model[f"{p}self_attn.proj_{n}_dense_layer.bias"] = r(64)
        for n in ("norm1", "norm3"):
            model[f"{p}{n}.weight"], model[f"{p}{n}.bias"] = r(64), r(64)
        model[f"{p}ffn.ffn.0.linear_layer.weight"], model[f"{p}ffn.ffn.0.linear_layer.bias"] = r(256, 64), r(256)
        model[f"{p}ffn.ffn.1.linear_layer.weight"], model[f"{p}ffn.ffn.1.linear_layer.bias"] = r(64, 256), r(64)
    return {
        "model": model,
        "optimizer": {
            "state": {0: {"exp_avg": r(4), "step": torch.tensor(10.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "lr_scheduler": {"last_epoch": 3, "base_lrs": [0.1]},
        "global_step": 10,
    }


@pytest.mark.parametrize("inner", ["", "model."])
def test_cs_1_9_to_2_9_checkpoint(tmp_path: Path, inner: str) -> None:
    from ckptconv.engine.simulator.checkpoint_io import write_checkpoint

    src = str(tmp_path / "checkpoint_10.mdl")
    state = _gpt2_cs_state(inner)
    write_checkpoint(src, state, cstorch_version="1.9.0")
    cfg = tmp_path / "params.yaml"
    cfg.write_text(yaml.safe_dump(LEGACY_GPT2))

    plan = plan_model(src, model="gpt2", src_fmt="cs-1.9", tgt_fmt="cs-2.9", config=str(cfg))
    assert plan.extras["path"][0] == "cs-1.9" and len(plan.extras["path"]) == 11 and not plan.unmatched
    r = convert_model(src, str(tmp_path / "out"), model="gpt2", src_fmt="cs-1.9", tgt_fmt="cs-2.9", config=str(cfg))
    assert r.target.endswith("checkpoint_10_to_cs-2.9.mdl")
    assert any("lm_head.weight" in w and "repaired" in w for w in r.warnings)

    from ckptconv.formats.detect import open_source

    out = open_source(r.target)
    try:
        entries = {e.key: e for e in out.entries()}
        read = {k: out.read(k) for k, e in entries.items() if e.kind in ("tensor", "array")}
        values = {k: e.value for k, e in entries.items() if e.kind == "value"}
    finally:
        out.close()
    m = f"model.{inner}"
    assert f"{m}embedding_layer.position_embeddings.embed.weight" in read
    assert f"{m}embedding_layer.position_embeddings.weight" not in read
    assert torch.equal(read[f"{m}lm_head.weight"], state["model"][f"{inner}embedding_layer.word_embeddings.weight"])
    assert torch.equal(read["optimizer.state.0.exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert values["global_step"] == 10 and values["lr_scheduler.last_epoch"] == 10  # src < 2.0: = global step
    assert values["__metadata__.0.version"] == "2.9.0"
    assert values["__metadata__.0.params.trainer.init.model.name"] == "gpt2"

    # the result reads back as cs-auto (from __metadata__) and converts to HF
    back = convert_model(r.target, str(tmp_path / "hf"), model="gpt2", src_fmt="cs-auto", tgt_fmt="hf")
    assert back.extras["model_conversion"]["source_format"] == "cs-2.9"
    assert any("training state is not converted" in w for w in back.warnings)
    hf = torch.load(next((Path(back.target)).glob("*.bin")), weights_only=True)
    assert torch.equal(
        hf["transformer.wpe.weight"], state["model"][f"{inner}embedding_layer.position_embeddings.weight"]
    )


def _iter_files(d: Path, samples: dict[int, int], step: int = 10) -> Path:
    d.mkdir()
    (d / "data_iter_checkpoint_state_file_global").write_text(f"{step}\n")
    for wrk, n in samples.items():
        (d / f"data_iter_state_file_worker_{wrk}_step_{step}.txt").write_text(f"{n}\n")
    return d


@pytest.mark.parametrize(
    ("processor", "expected"),
    [
        ("GptHDF5MapDataProcessor", {"dataloader.samples_streamed": 30, "dataloader.seed": 0}),
        (
            "GptHDF5DataProcessor",
            {
                "dataloader.all_worker_states.0.samples_streamed": 12,
                "dataloader.all_worker_states.0.shard_index": 0,
                "dataloader.all_worker_states.1.samples_streamed": 18,
                "dataloader.all_worker_states.1.shard_index": 1,
            },
        ),
    ],
)
def test_cs_1_9_upgrade_folds_in_the_dataloader_files(tmp_path: Path, processor: str, expected: dict) -> None:
    from ckptconv.engine.simulator.checkpoint_io import write_checkpoint
    from ckptconv.formats.detect import open_source

    src = str(tmp_path / "checkpoint_10.mdl")
    write_checkpoint(src, _gpt2_cs_state(""), cstorch_version="1.9.0")
    doc = {
        **LEGACY_GPT2,
        "cerebras": {"save_iter_state_path": str(_iter_files(tmp_path / "iters", {1: 18, 0: 12}))},
        "train_input": {"data_processor": processor},
    }
    cfg = tmp_path / "params.yaml"
    cfg.write_text(yaml.safe_dump(doc))

    plan = plan_model(src, model="gpt2", src_fmt="cs-1.9", tgt_fmt="cs-2.9", config=str(cfg))
    assert {s.out.key: s.out.value for s in plan.steps if s.out.key.startswith("dataloader.")} == expected
    r = convert_model(src, str(tmp_path / "out"), model="gpt2", src_fmt="cs-1.9", tgt_fmt="cs-2.9", config=str(cfg))
    assert any("dataloader state" in w for w in r.warnings)
    out = open_source(r.target)
    try:
        values = {e.key: e.value for e in out.entries() if e.kind == "value"}
        top = [str(k) for k in out.spec.context]
    finally:
        out.close()
    assert {k: v for k, v in values.items() if k.startswith("dataloader.")} == expected
    assert top.index("dataloader") < top.index("__metadata__")  # the release record stays last

    # Not from a 2.0 checkpoint (it keeps its own state); missing files are a typed error that says how to go on.
    newer = str(tmp_path / "checkpoint_2_0.mdl")
    write_checkpoint(newer, _gpt2_cs_state(""), cstorch_version="2.0.0")
    plan = plan_model(newer, model="gpt2", src_fmt="cs-2.0", tgt_fmt="cs-2.9", config=str(cfg))
    assert not [s for s in plan.steps if s.out.key.startswith("dataloader")]
    doc["cerebras"]["save_iter_state_path"] = str(tmp_path / "nowhere")
    cfg.write_text(yaml.safe_dump(doc))
    with pytest.raises(DataloaderStateError, match="nowhere") as err:
        plan_model(src, model="gpt2", src_fmt="cs-1.9", tgt_fmt="cs-2.9", config=str(cfg))
    assert "remove cerebras.save_iter_state_path" in (err.value.hint or "")


def test_hf_to_old_release_renames(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    )
    model.save_pretrained(tmp_path / "hf")
    r = convert_model(str(tmp_path / "hf"), str(tmp_path / "cs"), model="gpt2", src_fmt="hf", tgt_fmt="cs-1.8")
    from ckptconv.formats.detect import open_source

    src = open_source(r.target)
    try:
        keys = {e.key for e in src.entries()}
        assert src.info["release"] == "1.8"
    finally:
        src.close()
    assert "model.embedding_layer.position_embeddings.weight" in keys
    doc = yaml.safe_load(Path(str(tmp_path / "cs" / "config_to_cs-1.8.yaml")).read_text())
    assert "norm_type" not in doc["model"]  # 2.0 introduced norm_type
    back = convert_model(
        r.target,
        str(tmp_path / "hf2"),
        model="gpt2",
        src_fmt="cs-auto",
        tgt_fmt="hf",
        config=str(tmp_path / "cs" / "config_to_cs-1.8.yaml"),
    )
    assert back.extras["model_conversion"]["path"] == ["cs-1.8", "cs-1.9", "cs-2.0", "cs-2.1", "hf"]


def test_bert_release_1_6_used_hf_names(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ckptconv.engine.simulator.checkpoint_io import write_checkpoint

    cfg = transformers.BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(cfg)
    hf.save_pretrained(tmp_path / "hf")
    sd = {k: v.clone() for k, v in hf.state_dict().items() if "position_ids" not in k}
    old = str(tmp_path / "bert_16.mdl")
    write_checkpoint(
        old,
        {"model": sd, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}, "global_step": 5},
        cstorch_version="1.6.0",
    )
    cs29 = convert_config_dict(
        json_load(tmp_path / "hf" / "config.json"), model="bert", src_fmt="hf", tgt_fmt="cs-2.9"
    ).target
    m = {k: v for k, v in cs29["model"].items() if k not in ("pooler_nonlinearity", "mlm_nonlinearity", "name")}
    (tmp_path / "params_16.yaml").write_text(yaml.safe_dump({"model": m}))

    up = convert_model(
        old,
        str(tmp_path / "up"),
        model="bert",
        src_fmt="cs-1.6",
        tgt_fmt="cs-2.9",
        config=str(tmp_path / "params_16.yaml"),
    )
    assert any("optimizer" in w for w in up.warnings)
    from ckptconv.formats.detect import open_source

    src = open_source(up.target)
    try:
        keys = {e.key for e in src.entries()}
    finally:
        src.close()
    assert "model.bert_encoder.embedding_layer.position_embeddings.embed.weight" in keys
    assert "global_step" in keys and not any(k.startswith("optimizer") for k in keys)
    up_cfg = next(o.uri for o in up.outputs if o.uri.endswith(".yaml"))
    # before 1.8 the pooler used the encoder's activation (gelu here): Hugging Face cannot say that
    from ckptconv.core.errors import ConfigConversionError

    with pytest.raises(ConfigConversionError, match="pooler_nonlinearity"):
        convert_model(up.target, str(tmp_path / "hf_back"), model="bert", src_fmt="cs-2.9", tgt_fmt="hf", config=up_cfg)
    down = convert_model(
        up.target, str(tmp_path / "down"), model="bert", src_fmt="cs-2.9", tgt_fmt="cs-1.6", config=up_cfg
    )
    src = open_source(down.target)
    try:
        got = {e.key[len("model.") :]: src.read(e.key) for e in src.entries() if e.key.startswith("model.")}
    finally:
        src.close()
    for k, v in sd.items():  # every 1.6 (HF-named) tensor comes back unchanged
        assert torch.equal(got[k], v), k


def json_load(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def test_cs_auto_reads_newer_releases_as_the_newest_known(tmp_path: Path) -> None:
    from ckptconv.engine.simulator.checkpoint_io import write_checkpoint

    state = _gpt2_cs_state("")
    state["model"]["lm_head.weight"] = state["model"]["embedding_layer.word_embeddings.weight"]
    state["model"]["embedding_layer.position_embeddings.embed.weight"] = state["model"].pop(
        "embedding_layer.position_embeddings.weight"
    )
    cfg = convert_config_dict(LEGACY_GPT2, model="gpt2", src_fmt="cs-1.9", tgt_fmt="cs-2.9").target
    state["__metadata__"] = [{"version": "2.10.0", "model_name": "GPT2LMHeadModel", "params": cfg}]
    src = str(tmp_path / "checkpoint_100.mdl")
    write_checkpoint(src, state, cstorch_version="2.10.0")
    plan = plan_model(src, model="gpt2", src_fmt="cs-auto", tgt_fmt="hf")  # config from __metadata__ params
    assert plan.extras["source_format"] == "cs-2.9"
    assert any("2.10" in w for w in plan.warnings) and not plan.unmatched
