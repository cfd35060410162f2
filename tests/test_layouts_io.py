"""Model conversions through the storage and format layers: dtypes, shards, pickles with tied
duplicates, S3 URIs, and the plan's memory bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama

from ckptconv.engine.layouts.api import convert_model, plan_model

transformers = pytest.importorskip("transformers")
T = transformers


def _llama(dtype: torch.dtype = torch.float32) -> object:
    return tiny_llama(dtype)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    for f in sorted(path.glob("*.bin")):
        out.update(torch.load(f, weights_only=True))
    return out


def test_bf16_is_preserved_and_sharded_index_in_and_out(tmp_path: Path) -> None:
    model = _llama(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # several shards + model.safetensors.index.json
    index = tmp_path / "hf" / "model.safetensors.index.json"
    assert index.exists()
    r = convert_model(str(index), str(tmp_path / "cs"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    assert r.target.endswith("/model_to_cs-2.9.mdl")  # base name from model.safetensors.index.json
    back = convert_model(
        r.target,
        str(tmp_path / "back"),
        model="llama",
        src_fmt="cs-2.9",
        tgt_fmt="hf",
        config=str(tmp_path / "cs" / "config_to_cs-2.9.yaml"),
        hf_shard_size="100KB",
    )
    out = Path(back.target)
    assert (out / "pytorch_model.bin.index.json").exists() and len(list(out.glob("*.bin"))) > 1
    orig, got = _tensors(tmp_path / "hf"), _tensors(out)
    for k, v in orig.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    weight_map = json.loads((out / "pytorch_model.bin.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(got)


def test_a_llama_layout_conversion_between_safetensors_and_h5_never_imports_torch(tmp_path: Path) -> None:
    # Its rules copy tensors and reorder rotary rows: bytes in, bytes out, both ways.
    import os
    import subprocess
    import sys

    _llama(torch.bfloat16).save_pretrained(tmp_path / "hf")
    root = Path(__file__).resolve().parent.parent
    script = (
        "import sys\n"
        "from ckptconv.engine.layouts.api import convert_model\n"
        "hf, cs, back = sys.argv[1:4]\n"
        "r = convert_model(hf, cs, model='llama', src_fmt='hf', tgt_fmt='cs-2.9')\n"
        "b = convert_model(r.target, back, model='llama', src_fmt='cs-2.9', tgt_fmt='hf',\n"
        "                  config=cs + '/config_to_cs-2.9.yaml', export_safetensors=True)\n"
        "assert r.verify['ok'] and b.verify['ok'], (r.verify, b.verify)\n"
        "print('torch' in sys.modules, b.target)\n"
    )
    args = [str(tmp_path / "hf"), str(tmp_path / "cs"), str(tmp_path / "back")]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    imported, back = out.stdout.split()
    assert imported == "False"
    orig, got = _tensors(tmp_path / "hf"), _tensors(Path(back))
    for k, v in orig.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k


def test_bin_input_with_tied_duplicates_is_copied_not_filled(tmp_path: Path) -> None:
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    (tmp_path / "hf").mkdir()
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # includes lm_head.weight (tied)
    torch.save(sd, tmp_path / "hf" / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path / "hf")
    r = convert_model(str(tmp_path / "hf" / "pytorch_model.bin"), None, model="gpt2", src_fmt="hf", tgt_fmt="cs-2.9")
    assert r.target == str(tmp_path / "hf" / "pytorch_model_to_cs-2.9.mdl")  # beside the input
    assert not any("filled" in w for w in r.warnings)
    assert (tmp_path / "hf" / "config_to_cs-2.9.yaml").exists()


def test_plan_memory_bound_is_one_fused_group(tmp_path: Path) -> None:
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    model.save_pretrained(tmp_path / "hf")
    from ckptconv.formats.detect import open_source

    src = open_source(str(tmp_path / "hf"))
    try:
        plan = plan_model(src, model="gpt2", src_fmt="hf", tgt_fmt="cs-2.9")
        sizes = {e.key: e.nbytes for e in src.entries()}
    finally:
        src.close()
    # steps reading the same source tensor run back to back: a fused c_attn feeds q, k, v in a row
    keys = [s.inputs for s in plan.steps]
    first = next(i for i, k in enumerate(keys) if k == ("transformer.h.0.attn.c_attn.weight",))
    assert keys[first : first + 3] == [("transformer.h.0.attn.c_attn.weight",)] * 3
    peak = plan.peak_memory_estimate(sizes)
    assert peak < sum(sizes.values()) / 2  # bounded by a few tensors, not the checkpoint


def test_s3_round_trip(s3_bucket: str, tmp_path: Path) -> None:
    import boto3

    model = _llama()
    model.save_pretrained(tmp_path / "hf")
    s3 = boto3.client("s3")
    for f in (tmp_path / "hf").iterdir():
        s3.upload_file(str(f), s3_bucket, f"models/llama/{f.name}")
    src = f"s3://{s3_bucket}/models/llama"
    r = convert_model(src, f"s3://{s3_bucket}/out", model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    assert r.target == f"s3://{s3_bucket}/out/model_to_cs-2.9.mdl"
    back = convert_model(
        r.target,
        f"s3://{s3_bucket}/back",
        model="llama",
        src_fmt="cs-auto",
        tgt_fmt="hf",
        config=f"s3://{s3_bucket}/out/config_to_cs-2.9.yaml",
        export_safetensors=True,
    )
    local = tmp_path / "back"
    local.mkdir()
    for obj in s3.list_objects_v2(Bucket=s3_bucket, Prefix="back/")["Contents"]:
        s3.download_file(s3_bucket, obj["Key"], str(local / Path(obj["Key"]).name))
    assert back.target.endswith("model_to_cs-2.9_to_hf")
    got, orig = _tensors(local), _tensors(tmp_path / "hf")
    assert all(torch.equal(got[k], v) for k, v in orig.items())
