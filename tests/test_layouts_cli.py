"""`ckptconv models / convert-model / convert-config`, the `convert-model` job kind and GET /v1/models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_llama as tiny_llama_model

from ckptconv.cli import main
from ckptconv.core.errors import InvalidRequest
from ckptconv.jobs.kinds import get_kind

ROOT = Path(__file__).resolve().parent.parent
transformers = pytest.importorskip("transformers")


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    tiny_llama_model().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_models_list_and_detail(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama " in out and "hf, cs-1.9..cs-2.9" in out
    assert "hf (image_model/ + text_model/) <-> cs-2.2 ... cs-2.9" in out  # llava
    assert "not convertible" not in out  # every Model Zoo name converts
    assert main(["models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert models["sqlcoder"]["family"] == "starcoder" and models["mixtral"]["formats"][1] == "cs-2.3"
    assert main(["models", "falcon-headless"]) == 0
    assert "  h.{layer}.self_attention.query_key_value.{wb} <-> " in capsys.readouterr().out
    assert main(["models", "nope"]) == 2
    assert "unknown_model" in capsys.readouterr().err


def test_convert_model_round_trip(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(
        [
            "convert-model",
            str(tiny_llama),
            str(out),
            "--model",
            "llama",
            "--src-fmt",
            "hf",
            "--tgt-fmt",
            "cs-current",
            "--no-progress",
            "--verify",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert (out / "model_to_cs-2.9.mdl").exists() and (out / "config_to_cs-2.9.yaml").exists()
    assert "simulator: pass" in text and "verified: OK" in text
    rc = main(
        [
            "convert-model",
            str(out / "model_to_cs-2.9.mdl"),
            str(tmp_path / "back"),
            "--model",
            "llama",
            "--src-fmt",
            "cs-auto",
            "--tgt-fmt",
            "hf",
            "--config",
            str(out / "config_to_cs-2.9.yaml"),
            "--export-safetensors",
            "--json",
            "--no-progress",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["target"].endswith("model_to_cs-2.9_to_hf")
    names = {Path(o["uri"]).name for o in result["outputs"]}
    assert names >= {"model-00001-of-00001.safetensors", "model.safetensors.index.json", "config.json"}  # as MZ
    loaded = transformers.LlamaForCausalLM.from_pretrained(result["target"])
    assert loaded.config.num_key_value_heads == 2


@pytest.mark.parametrize("parallelism", [1, 2])
def test_a_config_name_taken_beside_the_target_refuses_the_model_conversion_before_any_work(
    tiny_llama: Path, tmp_path: Path, parallelism: int
) -> None:
    # A model conversion publishes its config beside the checkpoint file: with that name taken by
    # other bytes the publication could only fail, so the job must fail before it reads a tensor.
    from ckptconv.core.errors import TargetExists
    from ckptconv.engine.layouts.api import convert_model

    out = tmp_path / "out"
    out.mkdir()
    (out / "config_to_cs-2.9.yaml").write_text("someone else's config\n")
    stages: list[str] = []
    with pytest.raises(TargetExists, match=r"config_to_cs-2\.9\.yaml"):
        convert_model(
            str(tiny_llama),
            str(out),
            model="llama",
            src_fmt="hf",
            tgt_fmt="cs-2.9",
            parallelism=parallelism,
            progress=lambda p: stages.append(p.stage),
        )
    assert stages == [] and sorted(p.name for p in out.iterdir()) == ["config_to_cs-2.9.yaml"]
    assert (out / "config_to_cs-2.9.yaml").read_text() == "someone else's config\n"


def test_a_config_beside_the_target_holding_the_bytes_to_write_is_no_obstacle(tiny_llama: Path, tmp_path: Path) -> None:
    # Publication accepts a final name that already holds the staged bytes; so does the early check.
    from ckptconv.engine.layouts.api import convert_model

    first = convert_model(str(tiny_llama), str(tmp_path / "out"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    Path(first.target).unlink()
    Path(first.manifest).unlink()
    again = convert_model(str(tiny_llama), str(tmp_path / "out"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    assert Path(again.target).exists() and Path(again.manifest).exists()


def test_convert_model_dry_run_and_errors(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["convert-model", str(tiny_llama), "--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9", "--dry-run"]
    )
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["tensors"] == 22 and plan["path"] == ["hf", "cs-2.9"]
    assert plan["config"]["model"]["name"] == "llama" and plan["estimated_peak_memory_bytes"] > 0
    assert not (tiny_llama.parent / "model_to_cs-2.9.mdl").exists()
    # the wrong model: keys match no rule -> a clear error, nothing written
    rc = main(
        [
            "convert-model",
            str(tiny_llama),
            str(tmp_path / "o"),
            "--model",
            "gpt2",
            "--src-fmt",
            "hf",
            "--tgt-fmt",
            "cs-2.9",
            "--config",
            str(tiny_llama / "config.json"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and ("unmatched_keys" in err or "config_conversion_error" in err)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").glob("*.mdl"))
    rc = main(["convert-model", str(tiny_llama), "--model", "mixtral", "--src-fmt", "hf", "--tgt-fmt", "cs-2.1"])
    assert rc == 2 and "no_conversion_path" in capsys.readouterr().err


def test_convert_config_cli(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "convert-config",
            str(tiny_llama / "config.json"),
            "--model",
            "llama",
            "--src-fmt",
            "hf",
            "--tgt-fmt",
            "cs-2.9",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0 and (tmp_path / "config_to_cs-2.9.yaml").exists()
    capsys.readouterr()
    rc = main(
        [
            "convert-config",
            str(tmp_path / "config_to_cs-2.9.yaml"),
            "--model",
            "llama",
            "--src-fmt",
            "cs-2.9",
            "--tgt-fmt",
            "hf",
            "--json",
        ]
    )
    assert rc == 0 and json.loads(capsys.readouterr().out)["config"]["model_type"] == "llama"


def test_job_kind_handler_plan_and_run(tiny_llama: Path, tmp_path: Path) -> None:
    from ckptconv.jobs import context_from_request, handler, plan

    request = {
        "kind": "convert-model",
        "source": {"uri": str(tiny_llama)},
        "target": {"uri": str(tmp_path / "job"), "format": "cs-h5"},
        "options": {"model": "llama", "src_fmt": "hf", "tgt_fmt": "cs-2.9"},
    }
    doc = plan(context_from_request(request))
    assert doc["ok"] and doc["target"].endswith("job/model_to_cs-2.9.mdl")
    ctx = context_from_request(request, job_id="job-1")
    result = handler(ctx.kind).run(ctx)
    assert result["target"].endswith("model_to_cs-2.9.mdl") and result["verify"]["ok"]
    # Config keys no rule maps are on the job's result, as on the command line.
    assert any("Key not matched" in w and "use_cache" in w for w in result["warnings"])
    again = handler(ctx.kind).run(context_from_request(request, job_id="job-1"))  # redelivery is idempotent
    assert again["manifest"] == result["manifest"]
    bad = {**request, "target": {"uri": str(tmp_path / "x"), "format": "safetensors"}}
    from ckptconv.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        handler(ctx.kind).run(context_from_request(bad, job_id="job-2"))


def test_models_route_is_torch_free(redis_url: str) -> None:
    code = f"""
import sys
from fastapi.testclient import TestClient
from service.app import create_app
from ckptconv.core.settings import Settings
s = Settings(environment="development", auth_disabled=True, redis_url={redis_url!r})
with TestClient(create_app(s)) as c:
    r = c.get("/v1/models")
    assert r.status_code == 200, r.text
    names = {{m["name"] for m in r.json()["models"]}}
    assert {{"llama", "bert-q&a", "mpt-headless", "llava"}} <= names
    d = c.get("/v1/models/gpt-neox").json()
    assert d["family"] == "gpt-neox" and d["key_rules"], d
    assert c.get("/v1/models/nope").status_code == 404
    dpo = c.get("/v1/models/dpo").json()
    assert dpo["supported"] and dpo["family"] is None and "cs-2.9-dpo" in dpo["formats"] and dpo["key_rules"], dpo
    k = {{k["name"]: k for k in c.get("/v1/kinds").json()["kinds"]}}
    assert "convert-model" in k
assert "torch" not in sys.modules, "the API process imported torch"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_convert_model_options_take_dpo_formats() -> None:
    from pydantic import ValidationError

    from ckptconv.jobs.kinds import ConvertModelOptions

    ok = ConvertModelOptions(model="dpo", src_fmt="hf", tgt_fmt="cs-2.9-dpo")
    assert ok.tgt_fmt == "cs-2.9-dpo"
    ConvertModelOptions(model="dpo", src_fmt="cs-2.1-no-dpo", tgt_fmt="cs-2.1-dpo")
    for bad in ({"tgt_fmt": "hf-dpo"}, {"tgt_fmt": "cs-3.1-dpo"}, {"model": "nope"}):
        with pytest.raises(ValidationError):
            ConvertModelOptions(**{"model": "dpo", "src_fmt": "hf", "tgt_fmt": "cs-2.9-dpo", **bad})


def test_a_composite_model_fanned_out_to_its_hf_directories_is_refused_at_submission() -> None:
    from pydantic import ValidationError

    from ckptconv.jobs.kinds import ConvertModelOptions

    with pytest.raises(ValidationError, match="several model directories"):
        ConvertModelOptions(model="dpr", src_fmt="cs-2.9", tgt_fmt="hf", parallelism=2)
    for fine in (
        {"tgt_fmt": "hf", "parallelism": "auto"},  # picks 1
        {"tgt_fmt": "hf", "parallelism": 1},
        {"src_fmt": "hf", "tgt_fmt": "cs-2.9", "parallelism": 2},  # one .mdl: fans out
    ):
        ConvertModelOptions(**{"model": "dpr", "src_fmt": "cs-2.9", **fine})
    ConvertModelOptions(model="llama", src_fmt="cs-2.9", tgt_fmt="hf", parallelism=2)


def _lz4_datasets(path: Path) -> dict[str, bool]:
    """Every numeric dataset of a cs-h5 file with more than one element: LZ4-chunked or not."""
    import h5py

    found: dict[str, bool] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and obj.size > 1:
            plist = obj.id.get_create_plist()
            found[name] = obj.chunks is not None and plist.get_nfilters() == 1 and plist.get_filter(0)[0] == 32004

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def test_h5_compression_of_a_model_conversion(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--h5-compression lz4 on convert-model and on convert's model form: LZ4 chunks; without it, contiguous."""
    base = ["--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9", "--no-progress"]
    assert main(["convert-model", str(tiny_llama), str(tmp_path / "a"), *base, "--h5-compression", "lz4"]) == 0
    assert main(["convert", str(tiny_llama), str(tmp_path / "b"), *base, "--h5-compression", "lz4"]) == 0
    assert main(["convert-model", str(tiny_llama), str(tmp_path / "c"), *base]) == 0
    capsys.readouterr()
    for out, lz4 in (("a", True), ("b", True), ("c", False)):
        found = _lz4_datasets(tmp_path / out / "model_to_cs-2.9.mdl")
        assert found and set(found.values()) == {lz4}, (out, found)
    # A Hugging Face target is no cs-h5 file: refused, typed.
    cs = tmp_path / "c"
    back = f"{cs / 'model_to_cs-2.9.mdl'} {tmp_path / 'd'} --model llama --src-fmt cs-2.9 --tgt-fmt hf"
    rc = main(
        ["convert-model", *back.split(), "--config", str(cs / "config_to_cs-2.9.yaml"), "--h5-compression", "lz4"]
    )
    assert rc == 2 and "h5_compression applies to cs-h5 outputs" in capsys.readouterr().err


def test_a_model_conversion_dry_run_refuses_h5_compression_as_the_run_does(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dry run answers what the conversion would do: h5_compression for a Hugging Face output
    (torch or safetensors, no cs-h5 file) is refused by the plan as by the run, typed."""
    from ckptconv import jobs

    base = ["--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9", "--no-progress"]
    assert main(["convert-model", str(tiny_llama), str(tmp_path / "cs"), *base]) == 0
    capsys.readouterr()
    mdl, cfg = tmp_path / "cs" / "model_to_cs-2.9.mdl", tmp_path / "cs" / "config_to_cs-2.9.yaml"
    options = {"model": "llama", "src_fmt": "cs-2.9", "tgt_fmt": "hf", "config": str(cfg), "h5_compression": "lz4"}
    for safetensors, written in ((False, "torch"), (True, "safetensors")):
        request = {
            "kind": "convert-model",
            "source": {"uri": str(mdl)},
            "target": {"uri": str(tmp_path / "hf")},
            "options": {**options, "export_safetensors": safetensors},
        }
        with pytest.raises(InvalidRequest, match=f"h5_compression applies to cs-h5 outputs, not {written}"):
            jobs.plan(jobs.context_from_request(request))
        with pytest.raises(InvalidRequest, match=f"h5_compression applies to cs-h5 outputs, not {written}"):
            jobs.handler(get_kind("convert-model")).run(jobs.context_from_request(request, "job-1"))
    back = f"{mdl} {tmp_path / 'd'} --model llama --src-fmt cs-2.9 --tgt-fmt hf --config {cfg} --h5-compression lz4"
    assert main(["convert-model", *back.split(), "--dry-run"]) == 2
    assert "h5_compression applies to cs-h5 outputs" in capsys.readouterr().err
    # A cs-h5 output takes it, in the dry run as in the run.
    request = {
        "kind": "convert-model",
        "source": {"uri": str(tiny_llama)},
        "options": {"model": "llama", "src_fmt": "hf", "tgt_fmt": "cs-2.9", "h5_compression": "lz4"},
    }
    assert jobs.plan(jobs.context_from_request(request))["ok"]
