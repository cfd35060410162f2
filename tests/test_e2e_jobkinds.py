"""The service's job kinds beyond ``convert`` end to end: a real API process, a real Celery worker
process and real Redis run ``verify``, ``simulate``, ``fix-spec``, ``dataloader-state`` (and a
``convert`` to TensorFlow) on local files, and the results recorded on the jobs are checked
against the files the worker wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest
import torch
import yaml
from test_dataloader_state import iter_dir, old_checkpoint
from test_e2e_service import Service, bucket  # noqa: F401 - bucket is a fixture the service needs
from test_fix_spec import gpt_tree, tsd_class, write_legacy  # noqa: F401 - tsd_class is a fixture
from test_simulator_trainer import config as trainer_config

from ckptconv.core.errors import Forbidden, InvalidRequest, TargetTaken
from ckptconv.formats.cs_h5 import CsH5Source
from ckptconv.storage import open_storage

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobkinds").resolve()


@pytest.fixture(scope="module")
def service(redis_url: str, bucket: str, root: Path) -> Iterator[Service]:  # noqa: F811
    (root / "svc").mkdir()
    # Local paths are URIs like any other: the key's prefixes must cover them.
    svc = Service(redis_url, bucket, root / "svc", prefixes=[str(root / "data") + "/"], workers=1)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def data(root: Path, request: pytest.FixtureRequest) -> Path:
    d = root / "data" / request.node.name
    d.mkdir(parents=True)
    return d


def run(svc: Service, source: str, target: str | None = None, **kw) -> dict:
    with svc.client() as c:
        job = c.submit(source, target, **kw)
        return c.wait(job["id"], timeout=120)


def tiny_llama(path: Path, seed: int) -> Path:
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_verify_passes_for_a_conversion_and_fails_with_the_numbers_for_another_model(
    service: Service, data: Path
) -> None:
    from ckptconv.engine.layouts.api import convert_model

    hf = tiny_llama(data / "hf", seed=0)
    result = convert_model(str(hf), str(data / "cs"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    mdl = next(o.uri for o in result.outputs if o.uri.endswith(".mdl"))
    cfg = next(o.uri for o in result.outputs if o.uri.endswith(".yaml"))

    job = run(service, mdl, kind="verify", options={"hf": str(hf), "config": cfg, "model": "llama"})
    assert job["state"] == "succeeded", job.get("error")
    r = job["result"]
    assert r["verdict"] == "pass" and r["passed"] is True and r["tolerance"] == 1e-5
    assert r["max_abs_diff"] <= 1e-5 and r["max_rel_diff"] <= 1e-5 and r["cosine_similarity"] > 0.999999
    assert r["outputs"] == [] and set(r["logits"]) == {"logits"}

    other = tiny_llama(data / "other", seed=1)  # same shapes, other weights: the logits differ
    opts = {"hf": str(other), "config": cfg, "model": "llama"}
    job = run(service, mdl, kind="verify", options=opts)
    assert job["state"] == "failed"
    problem = job["error"]
    assert problem["code"] == "logit_mismatch", problem
    details = problem["details"]
    assert details["verdict"] == "fail" and details["max_abs_diff"] > 1e-5 and details["tolerance"] == 1e-5
    assert "cosine_similarity" in details and "logits" in details["logits"]

    job = run(service, mdl, kind="verify", options={**opts, "fail_on_mismatch": False})
    assert job["state"] == "succeeded" and job["result"]["passed"] is False


def test_convert_model_with_verify_records_the_simulator_verdict(service: Service, data: Path) -> None:
    hf = tiny_llama(data / "hf", seed=2)
    options = {"model": "llama", "src_fmt": "hf", "tgt_fmt": "cs-2.9", "verify": True}
    job = run(service, str(hf), str(data / "cs"), to="cs-h5", kind="convert-model", options=options)
    assert job["state"] == "succeeded", job.get("error")
    sim = job["result"]["simulator"]
    assert sim["verdict"] == "pass" and sim["max_abs_diff"] <= 1e-5 and sim["cs_checkpoint"] == job["result"]["target"]
    assert any(o["uri"].endswith(".mdl") for o in job["result"]["outputs"])


def test_dpr_round_trip_through_the_service(service: Service, data: Path) -> None:
    from test_layouts_dpr import _dpr

    _dpr(data / "hf")
    options = {"model": "dpr", "src_fmt": "hf", "tgt_fmt": "cs-2.9"}
    job = run(service, str(data / "hf"), str(data / "cs"), to="cs-h5", kind="convert-model", options=options)
    assert job["state"] == "succeeded", job.get("error")
    mdl = next(o["uri"] for o in job["result"]["outputs"] if o["uri"].endswith(".mdl"))
    cfg = next(o["uri"] for o in job["result"]["outputs"] if o["uri"].endswith(".yaml"))
    options = {"model": "dpr", "src_fmt": "cs-2.9", "tgt_fmt": "hf", "config": cfg, "export_safetensors": True}
    job = run(service, mdl, str(data / "back"), to="safetensors", kind="convert-model", options=options)
    assert job["state"] == "succeeded", job.get("error")
    names = {str(Path(o["uri"]).relative_to(job["result"]["target"])) for o in job["result"]["outputs"]}
    assert {"q_encoder/config.json", "ctx_encoder/model.safetensors.index.json"} <= names, names
    for o in job["result"]["outputs"]:  # every listed file is where it says, with its size
        assert Path(o["uri"]).stat().st_size == o["size"]
    loaded = transformers.DPRContextEncoder.from_pretrained(Path(job["result"]["target"]) / "ctx_encoder")
    assert loaded.config.model_type == "dpr"


def test_llava_plan_and_round_trip_through_the_service(service: Service, data: Path) -> None:
    from test_layouts_llava import CS_KEYS, llava_model, write_original

    original = write_original(data / "hf", llava_model())
    options = {"model": "llava", "src_fmt": "hf", "tgt_fmt": "cs-2.9"}
    with service.client() as c:
        plan = c.plan(str(data / "hf"), str(data / "cs"), to="cs-h5", kind="convert-model", options=options)
    assert plan["ok"] is True and not plan["unmatched_keys"], plan
    assert plan["config"]["model"]["projector"]["image_model"]["layers_units"] == [48, 48]
    assert not (data / "cs").exists()  # a dry run writes nothing
    job = run(service, str(data / "hf"), str(data / "cs"), to="cs-h5", kind="convert-model", options=options)
    assert job["state"] == "succeeded", job.get("error")
    mdl = next(o["uri"] for o in job["result"]["outputs"] if o["uri"].endswith(".mdl"))
    cfg = next(o["uri"] for o in job["result"]["outputs"] if o["uri"].endswith(".yaml"))
    options = {"model": "llava", "src_fmt": "cs-2.9", "tgt_fmt": "hf", "config": cfg, "export_safetensors": True}
    job = run(service, mdl, str(data / "back"), to="safetensors", kind="convert-model", options=options)
    assert job["state"] == "succeeded", job.get("error")
    target = Path(job["result"]["target"])
    names = {str(Path(o["uri"]).relative_to(target)) for o in job["result"]["outputs"]}
    assert {"image_model/preprocessor_config.json", "text_model/model.safetensors.index.json"} <= names, names
    from test_layouts_families import load_dir

    for part in ("image_model", "text_model"):
        got = load_dir(str(target / part))
        assert set(got) == set(original[part]) and all(torch.equal(got[k], v) for k, v in original[part].items())
    assert len(CS_KEYS) == sum(len(p) for p in original.values()) + 1  # + the final norm stored twice


def test_verify_refuses_uris_outside_the_keys_prefixes(service: Service, data: Path) -> None:
    with service.client() as c, pytest.raises(Forbidden):
        c.submit(str(data / "x.mdl"), kind="verify", options={"hf": "/elsewhere", "config": "/c", "model": "llama"})
    with service.client() as c, pytest.raises(InvalidRequest, match="unknown model"):
        c.submit(str(data / "x.mdl"), kind="verify", options={"hf": str(data), "config": "/c", "model": "nope"})


def test_simulate_lists_the_checkpoints_it_wrote(service: Service, data: Path) -> None:
    config = data / "params.yaml"
    config.write_text(yaml.safe_dump(trainer_config(checkpoint={"steps": 2}, max_steps=4)))
    job = run(service, str(config), kind="simulate", options={"model_dir": str(data / "model")})
    assert job["state"] == "succeeded", job.get("error")
    r = job["result"]
    assert r["global_step"] == 4 and len(r["checkpoints"]) == 2
    assert [o["uri"] for o in r["outputs"]] == r["checkpoints"]
    for o in r["outputs"]:
        path = Path(o["uri"])
        assert path.is_file() and path.stat().st_size == o["size"] and o["role"] == "checkpoint"
    assert sorted(p.name for p in (data / "model").glob("*.mdl")) == sorted(Path(u).name for u in r["checkpoints"])


def test_simulate_reports_steps_and_can_be_cancelled(service: Service, data: Path) -> None:
    from test_e2e_service import wait_for

    config = data / "params.yaml"
    config.write_text(yaml.safe_dump(trainer_config(checkpoint={"steps": 1000}, max_steps=100_000)))
    with service.client() as c:
        job = c.submit(str(config), kind="simulate", options={"model_dir": str(data / "model")})
        wait_for(lambda: ((c.get(job["id"]).get("progress") or {}).get("steps_done") or 0) >= 3, timeout=60)
        progress = c.get(job["id"])["progress"]
        assert progress["stage"] == "training" and progress["steps_total"] == 100_000
        # Steps, not the rounded fraction: a few steps of 100,000 round to a fraction of 0.0.
        assert 0 < progress["steps_done"] < progress["steps_total"] and 0 <= progress["fraction"] < 1
        c.cancel(job["id"])
        job = c.wait(job["id"], timeout=60)
    assert job["state"] == "cancelled" and job["error"]["code"] == "cancelled"
    assert job["progress"]["steps_done"] < 100_000


def test_fix_spec_repairs_a_legacy_checkpoint(service: Service, data: Path, tsd_class: type) -> None:  # noqa: F811
    legacy = data / "model.mdl"
    write_legacy(legacy, gpt_tree(), tsd_class)
    before = legacy.read_bytes()
    job = run(service, str(legacy), kind="fix-spec")
    assert job["state"] == "succeeded", job.get("error")
    r = job["result"]
    assert r["output"] == str(data / "model_fixed.mdl") and r["tensor_scalar_dict"] is True
    assert {link["key"] for link in r["links"]} == {"model.lm_head.weight", "model.transformer_decoder.norm.bias"}
    assert r["last_epoch"]["lr_scheduler._schedulers.1.last_epoch"] == 150
    assert legacy.read_bytes() == before
    [out] = r["outputs"]
    assert out["uri"] == r["output"] and out["size"] == Path(r["output"]).stat().st_size
    with h5py.File(r["output"], "r") as f:
        assert b"TensorScalarDict" not in bytes.fromhex(f.attrs["__spec__"])

    # An explicit target; the same target again is refused at submit (never overwritten).
    target = str(data / "fixed" / "repaired.mdl")
    (data / "fixed").mkdir()
    job = run(service, str(legacy), target, to="cs-h5", kind="fix-spec")
    assert job["state"] == "succeeded" and job["result"]["output"] == target
    with pytest.raises(TargetTaken):
        run(service, str(legacy), target, to="cs-h5", kind="fix-spec")


def test_dataloader_state_is_added_as_the_2_0_entry(service: Service, data: Path) -> None:
    src = old_checkpoint(data / "old.mdl")
    states = iter_dir(data)
    target = str(data / "new.mdl")
    job = run(service, src, target, to="cs-h5", kind="dataloader-state", options={"iter_dir": str(states)})
    assert job["state"] == "succeeded", job.get("error")
    assert job["result"]["extras"]["dataloader"]["samples_streamed"] == 1000 + 1024 + 998
    # Published with a manifest naming the job, so a re-delivered job finds its finished output.
    assert json.loads(Path(job["result"]["manifest"]).read_text())["job_id"] == job["id"]
    with CsH5Source(open_storage(target), target) as out:
        keys = {e.key for e in out.entries()}
    assert {"model.w", "model.b", "global_step"} < keys and any(k.startswith("dataloader") for k in keys)


def test_convert_to_tensorflow(service: Service, data: Path) -> None:
    from safetensors.torch import save_file

    from ckptconv.formats.detect import open_source

    tensors = {"a.weight": torch.randn(4, 3), "b.bias": torch.arange(5, dtype=torch.int64)}
    save_file(tensors, data / "model.safetensors")
    target = str(data / "tf" / "ckpt")
    job = run(service, str(data / "model.safetensors"), target, to="tf")
    assert job["state"] == "succeeded", job.get("error")
    with open_source(target, "tf") as src:
        assert {k: src.read(k) for k in tensors}.keys() == tensors.keys()
        for k, v in tensors.items():
            assert torch.equal(src.read(k), v)


def test_convert_h5_compression_option(service: Service, data: Path) -> None:
    """options.h5_compression lz4: LZ4-chunked datasets; the default: contiguous ones; with
    parallelism > 1 refused at submission (a compressed file cannot be laid out up front)."""
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(512, 1024), "b": torch.arange(16, dtype=torch.float32)}, data / "model.safetensors")
    src = str(data / "model.safetensors")
    plain = run(service, src, str(data / "plain.mdl"), to="cs-h5")
    packed = run(service, src, str(data / "lz4.mdl"), to="cs-h5", options={"h5_compression": "lz4"})
    assert plain["state"] == packed["state"] == "succeeded", (plain.get("error"), packed.get("error"))
    with h5py.File(data / "plain.mdl", "r") as a, h5py.File(data / "lz4.mdl", "r") as b:
        for name in ("w", "b"):
            assert a[name].chunks is None and a[name].id.get_create_plist().get_nfilters() == 0
            assert b[name].chunks is not None and b[name].id.get_create_plist().get_filter(0)[0] == 32004
    assert packed["result"]["outputs"][0]["size"] < plain["result"]["outputs"][0]["size"] / 10
    with service.client() as c, pytest.raises(InvalidRequest, match="written by one worker"):
        c.submit(src, str(data / "fanned.mdl"), to="cs-h5", options={"h5_compression": "lz4", "parallelism": 2})
