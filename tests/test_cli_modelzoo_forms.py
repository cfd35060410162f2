"""The Model Zoo's ``convert_checkpoint.py`` command forms, typed as its run books type them:
``list`` / ``list-converters``, ``info``, ``diff``, ``convert --model ... CKPT --output-dir D``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tiny_models import tiny_llama as tiny_llama_model

from ckptconv.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "hf"
    tiny_llama_model().save_pretrained(path)
    return path


def test_list_converters_is_the_models_view(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    models_view = capsys.readouterr().out
    assert main(["list-converters"]) == 0
    assert capsys.readouterr().out == models_view
    assert main(["list", "all"]) == 0  # the Model Zoo's older name and its default argument
    assert capsys.readouterr().out == models_view
    llama_row = next(line for line in models_view.splitlines() if line.startswith("llama "))
    assert "LlamaForCausalLM <-> GPT2LMHeadModel" in llama_row  # HF class beside the Cerebras class
    assert "note:" in models_view
    assert main(["list-converters", "--hide-notes"]) == 0
    assert "note:" not in capsys.readouterr().out
    # The Model Zoo lower-cases the name; case-sensitive names (llamaV2) still resolve.
    assert main(["list-converters", "LLAMAV2"]) == 0
    detail = capsys.readouterr().out
    assert "model:    llamaV2 (alias of llama)" in detail and "CS class: GPT2LMHeadModel" in detail


def test_bert_summarization_shows_its_own_classes_and_notes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list-converters", "bert-summarization", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["cs_class"] == "BertSummarizationModel" and view["hf_architectures"] == []
    assert "hf" not in view["formats"]
    # Only its own note: the BERT family's note about Hugging Face safetensors inputs does not apply.
    assert len(view["notes"]) == 1 and "no Hugging Face layout" in view["notes"][0]
    assert main(["models", "bert-sequence-classifier", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cs_class"] == "BertForSequenceClassification"
    assert main(["models", "dpr", "--json"]) == 0
    dpr = json.loads(capsys.readouterr().out)
    assert dpr["cs_class"] == "DPRModel" and dpr["hf_architectures"] == ["DPRQuestionEncoder", "DPRContextEncoder"]


def test_convert_with_model_flags_is_the_model_conversion(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["convert", "--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9", "--output-dir", str(out)]
    rc = main([*argv, "--config", str(tiny_llama / "config.json"), "--no-progress-bar", str(tiny_llama)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert sorted(p.name for p in out.iterdir()) == [
        "config_to_cs-2.9.yaml",
        "model_to_cs-2.9.mdl",
        "model_to_cs-2.9.mdl.manifest.json",
    ]
    # Config keys without a rule are listed, not silently dropped.
    warning = next(line for line in text.splitlines() if "Key not matched" in line)
    assert "pretraining_tp" in warning and "use_cache" in warning
    # Back to Hugging Face, named as the Model Zoo names it: <base>_to_hf/ with shards and an index.
    rc = main(
        [
            "convert",
            str(out / "model_to_cs-2.9.mdl"),
            "--model",
            "llama",
            "--src-fmt",
            "cs-2.9",
            "--tgt-fmt",
            "hf",
            "--config",
            str(out / "config_to_cs-2.9.yaml"),
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr()
    back = out / "model_to_cs-2.9_to_hf"
    assert sorted(p.name for p in back.iterdir()) == [
        "config.json",
        "manifest.json",
        "pytorch_model-00001-of-00001.bin",
        "pytorch_model.bin.index.json",
    ]
    capsys.readouterr()
    # convert-model takes --output-dir as well as its positional directory
    rc = main(
        [
            "convert-model",
            str(tiny_llama),
            "--output-dir",
            str(tmp_path / "cm"),
            "--model",
            "llama",
            "--src-fmt",
            "hf",
            "--tgt-fmt",
            "cs-2.8",
            "--no-progress",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["target"] == str(tmp_path / "cm" / "model_to_cs-2.8.mdl")
    assert any("Key not matched" in w for w in result["warnings"])


def test_convert_forms_refuse_mixed_flags(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["convert", str(tiny_llama), "--model", "llama", "--src-fmt", "hf"])
    assert rc == 2 and "--tgt-fmt" in capsys.readouterr().err
    rc = main(["convert", str(tiny_llama), "--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9", "--to", "tf"])
    assert rc == 2 and "container conversion" in capsys.readouterr().err
    rc = main(["convert", str(tiny_llama), str(tmp_path / "x.mdl"), "--to", "cs-h5", "--output-dir", str(tmp_path)])
    assert rc == 2 and "--output-dir" in capsys.readouterr().err
    rc = main(["convert", str(tiny_llama)])
    err = capsys.readouterr().err
    assert rc == 2 and "--model, --src-fmt and --tgt-fmt" in err
    model_flags = ["--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9"]
    two_dirs = [str(tmp_path / "a"), "--output-dir", str(tmp_path / "b")]
    rc = main(["convert-model", str(tiny_llama), *two_dirs, *model_flags])
    assert rc == 2 and "two output directories" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_info_is_inspect(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tiny_llama), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert main(["info", str(tiny_llama), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == inspected


def test_diff_across_formats(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mdl = tmp_path / "same.mdl"
    assert main(["convert", str(tiny_llama), str(mdl), "--to", "cs-h5", "--no-progress"]) == 0
    capsys.readouterr()
    # The same tensors in a Cerebras H5 file and in safetensors: identical, exit status 0.
    assert main(["diff", str(tiny_llama / "model.safetensors"), str(mdl), "--no-progress"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("identical")

    tensors = load_file(tiny_llama / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    changed = dict(tensors)
    changed[key] = tensors[key].clone()
    changed[key][0, 0] += 1e-9  # below allclose's atol, not bit-equal
    changed["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    changed["model.extra"] = torch.zeros(3)
    del changed["model.layers.1.mlp.down_proj.weight"]
    changed["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"].reshape(1, -1)
    other = tmp_path / "other.safetensors"
    save_file(changed, other)

    assert main(["diff", str(mdl), str(other), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["only_in_a"] == ["model.layers.1.mlp.down_proj.weight"] and doc["only_in_b"] == ["model.extra"]
    by_key = {d["key"]: d for d in doc["differences"]}
    assert by_key[key]["what"] == ["values"] and 0 < by_key[key]["max_abs_diff"] < 1e-8
    assert by_key["model.norm.weight"]["what"][0] == "dtype"
    assert by_key["model.layers.0.input_layernorm.weight"]["what"] == ["shape"]
    assert set(by_key) == {key, "model.norm.weight", "model.layers.0.input_layernorm.weight"}

    assert main(["diff", str(mdl), str(other), "--tensor_comparison_op", "allclose", "--json"]) == 1
    keys = {d["key"] for d in json.loads(capsys.readouterr().out)["differences"]}
    assert key not in keys  # within rtol 1e-5 / atol 1e-8
    assert main(["diff", str(mdl), str(other), "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert "only in A: model.layers.1.mlp.down_proj.weight" in text and "checkpoints differ" in text
    assert "dtype:     model.norm.weight  float32 vs bfloat16" in text


def test_diff_counts_nan_and_infinities_as_stored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = torch.tensor([1.0, float("nan"), float("inf"), -0.0])
    save_file({"w": w, "v": torch.arange(4)}, tmp_path / "a.safetensors")
    save_file({"w": w.clone(), "v": torch.arange(4)}, tmp_path / "b.safetensors")
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--no-progress"]) == 0
    capsys.readouterr()
    save_file({"w": torch.tensor([1.0, 2.0, float("inf"), 0.0]), "v": torch.arange(4) + 1}, tmp_path / "c.safetensors")
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors"), "--json"]) == 1
    by_key = {d["key"]: d for d in json.loads(capsys.readouterr().out)["differences"]}
    assert by_key["w"]["max_abs_diff"] == float("inf")  # NaN on one side only
    assert by_key["v"]["max_abs_diff"] == 1.0 and by_key["v"]["max_rel_diff"] == 1.0


@pytest.mark.parametrize(
    "bits_a, bits_b",
    [
        ([0x00000000, 0x3F800000], [0x80000000, 0x3F800000]),  # 0.0 and -0.0: equal numbers, other bits
        ([0x7FC00000, 0x3F800000], [0x7FC00001, 0x3F800000]),  # quiet NaNs with other payloads
    ],
    ids=["signed-zero", "nan-payload"],
)
def test_equal_compares_bits_and_allclose_numbers(tmp_path: Path, bits_a: list[int], bits_b: list[int]) -> None:
    def floats(bits: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32))

    save_file({"w": floats(bits_a)}, tmp_path / "a.safetensors")
    save_file({"w": floats(bits_b)}, tmp_path / "b.safetensors")
    files = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--no-progress"]
    assert main(["diff", *files]) == 1
    assert main(["diff", *files, "--tensor_comparison_op", "equal"]) == 1
    assert main(["diff", *files, "--tensor_comparison_op", "allclose"]) == 0


def test_diff_of_dtypes_torch_cannot_promote(tmp_path: Path) -> None:
    # float8 has no promotion rules and no allclose kernel, uint16 none with int32: compared widened.
    from ckptconv import diff

    x = torch.tensor([0.5, -1.25, 3.0, 448.0])
    a = {"f8": x.to(torch.float8_e4m3fn), "mixed": x.to(torch.float8_e4m3fn), "u": torch.arange(4).to(torch.uint16)}
    b = {"f8": x.to(torch.float8_e4m3fn), "mixed": x, "u": torch.arange(4, dtype=torch.int32)}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    for op in ("equal", "allclose"):
        result = diff(str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), op=op)
        by_key = {d.key: d for d in result.differences}
        assert set(by_key) == {"mixed", "u"}  # f8 equal to itself under allclose too
        assert by_key["mixed"].what == ["dtype"] and by_key["u"].what == ["dtype"]  # same values
    save_file({**b, "f8": (x * 2).to(torch.float8_e5m2)}, tmp_path / "c.safetensors")
    result = diff(str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors"), op="allclose")
    f8 = next(d for d in result.differences if d.key == "f8")
    assert f8.what == ["dtype", "values"] and f8.max_abs_diff == 448.0


def test_cerebras_classes_agree_with_the_simulator() -> None:
    from ckptconv.engine.layouts.registry import list_models
    from ckptconv.engine.simulator.config import MODEL_CLASSES

    listed = {m["name"]: m.get("cs_class") for m in list_models()}
    assert {name: listed[name] for name in MODEL_CLASSES} == MODEL_CLASSES


def test_convert_debug_prints_each_match(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The Model Zoo's `convert ... --debug` prints every "old -> new" match; run books pass it.
    form = ["convert", str(tiny_llama), "--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9"]
    assert main([*form, "--output-dir", str(tmp_path / "out"), "--debug", "--no-progress-bar"]) == 0
    matches = capsys.readouterr().err.splitlines()
    assert "copy(model.embed_tokens.weight) -> model.embedding_layer.word_embeddings.weight" in matches
    assert (tmp_path / "out" / "model_to_cs-2.9.mdl").is_file()


def test_listing_into_a_closed_pipe_ends_quietly() -> None:
    # `ckptconv list-converters | head -1`: the reader has left; no traceback on stderr.
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first write fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptconv", "list-converters"], stdout=write_end, stderr=subprocess.PIPE, check=False
        )
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == 141 and "Traceback" not in err, err


def test_export_lists_cerebras_config_keys_no_rule_maps(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cs"
    to_cs = ["--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9"]
    rc = main(["convert-model", str(tiny_llama), str(out), *to_cs])
    assert rc == 0
    config = out / "config_to_cs-2.9.yaml"
    doc = yaml.safe_load(config.read_text())
    doc["model"]["a_setting_of_our_own"] = 3
    config.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    argv = ["convert-model", str(out / "model_to_cs-2.9.mdl"), str(tmp_path / "hf"), "--model", "llama"]
    rc = main([*argv, "--src-fmt", "cs-2.9", "--tgt-fmt", "hf", "--config", str(config), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0
    warning = next(w for w in result["warnings"] if "Key not matched" in w)
    listed = set(warning.split(": ", 2)[-1].split(", "))
    assert "a_setting_of_our_own" in listed
    # keys the rules read are not listed
    assert not listed & {"hidden_size", "num_hidden_layers", "vocab_size", "num_heads", "position_embedding_type"}
