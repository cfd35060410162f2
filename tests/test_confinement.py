"""Confinement corpus: a key reaches only its prefixes, whatever its requests or its files name.

A real API process, a real Celery worker and a moto S3 server of this module's own, whose access
log records every request the worker makes. The key may touch ``s3://<bucket>/team/`` and
``<root>/team/``; canaries sit just outside (``team2/``, the object ``team``, the bucket
``<bucket>-x``, ``<root>/secret/``). Every URI-bearing request field is tried with escapes
(``..``, percent-encodings, case, double slashes, other buckets, relative paths); then jobs whose
*files* name URIs outside (a simulate config's ``checkpoint_root``, ``checkpoints_index.yaml``
entries, a 1.x config's ``cerebras.save_iter_state_path``, shard maps) run to their end. Afterwards
the access log shows no request outside ``team/`` and nothing outside the prefixes changed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import yaml
from s3_access_log import AccessLoggedS3, aws_environ
from test_e2e_service import Service
from test_layouts_upgrades import LEGACY_GPT2, _gpt2_cs_state, _iter_files
from test_simulator_trainer import config as trainer_config

from ckptconv.engine.simulator.checkpoint_io import write_checkpoint

REFUSED = {"forbidden", "path_escape", "invalid_request"}
BURST = {"CKPTCONV_RATE_LIMIT_PER_SECOND": "0"}  # the corpus is a burst of requests from one key


@pytest.fixture(scope="module")
def world(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("confinement").resolve()
    s3 = AccessLoggedS3(tmp / "s3-access.log")
    with aws_environ(s3.endpoint):
        bucket = f"conf-{uuid.uuid4().hex[:10]}"
        client = boto3.client("s3", endpoint_url=s3.endpoint)
        for name in (bucket, bucket + "-x"):
            client.create_bucket(Bucket=name)
        root = tmp / "root"
        (root / "team").mkdir(parents=True)
        (tmp / "svc").mkdir()
        svc = Service(
            redis_url, bucket, tmp / "svc", prefixes=[f"s3://{bucket}/team/", f"{root}/team/"], env=BURST, workers=1
        )
        try:
            yield {"svc": svc, "s3": s3, "bucket": bucket, "root": root, "client": client}
        finally:
            svc.stop()
            s3.stop()


def put(world: dict[str, Any], key: str, body: bytes, bucket: str | None = None) -> None:
    world["client"].put_object(Bucket=bucket or world["bucket"], Key=key, Body=body)


def snapshot_s3(world: dict[str, Any]) -> dict[tuple[str, str], str]:
    out = {}
    for b in (world["bucket"], world["bucket"] + "-x"):
        for page in world["client"].get_paginator("list_objects_v2").paginate(Bucket=b):
            for obj in page.get("Contents", []):
                out[(b, obj["Key"])] = obj["ETag"]
    return out


def snapshot_local(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and not str(p).startswith(str(root / "team") + "/")
    }


def canaries(world: dict[str, Any], tmp: Path) -> dict[str, str]:
    """Valid checkpoints and dataloader files outside the prefixes (a missing check would load them)."""
    b, root = world["bucket"], world["root"]
    state = {"model": {"w": __import__("torch").ones(2, 2)}, "global_step": 1}
    local_ckpt = str(root / "secret" / "canary.mdl")
    (root / "secret").mkdir(exist_ok=True)
    write_checkpoint(local_ckpt, state, cstorch_version="2.4.0")
    s3_ckpt = tmp / "canary.mdl"
    write_checkpoint(str(s3_ckpt), state, cstorch_version="2.4.0")
    for bucket, key in ((b, "team2/canary.mdl"), (b + "-x", "team/canary.mdl"), (b, "team")):
        put(world, key, s3_ckpt.read_bytes(), bucket)
    iters = _iter_files(root / "secret" / "iter_state", {0: 12, 1: 18})
    for p in iters.iterdir():
        put(world, f"team2/iter_state/{p.name}", p.read_bytes())
    return {
        "s3_ckpt": f"s3://{b}/team2/canary.mdl",
        "other_bucket_ckpt": f"s3://{b}-x/team/canary.mdl",
        "local_ckpt": local_ckpt,
        "s3_iters": f"s3://{b}/team2/iter_state",
        "local_iters": str(iters),
    }


def escapes(world: dict[str, Any], name: str) -> list[str]:
    """URIs outside the prefixes, spelled every way that has fooled a string check somewhere."""
    b, root = world["bucket"], world["root"]
    return [
        f"s3://{b}/team2/{name}",
        f"s3://{b}/team/../team2/{name}",
        f"s3://{b}/team/%2e%2e/team2/{name}",
        f"s3://{b}/team/%2E%2E%2Fteam2/{name}",
        f"s3://{b}/team/..%5cteam2/{name}",
        f"S3://{b}/team2/{name}",
        f"s3://{b.upper()}/team/{name}",
        f"s3://{b}//team/{name}",
        f"s3://{b}/team",
        f"s3://{b}-x/team/{name}",
        f"{root}/secret/{name}",
        f"{root}/team/../secret/{name}",
        f"file://{root}/team/../secret/{name}",
        f"file://{root}/team2/{name}",
        f"{root}/team2/{name}",
        "team/" + name,
        "/etc/passwd",
    ]


def final(c: Any, job_id: str) -> dict[str, Any]:
    return c.wait(job_id, timeout=300)


def test_confinement_corpus(world: dict[str, Any], tmp_path: Path) -> None:
    svc, s3, b, root = world["svc"], world["s3"], world["bucket"], world["root"]
    canary = canaries(world, tmp_path)
    team_s3, team_local = f"s3://{b}/team", str(root / "team")

    src = tmp_path / "params.yaml"
    src.write_text(yaml.safe_dump(trainer_config(checkpoint={"steps": 1}, max_steps=1)))
    put(world, "team/ok/params.yaml", src.read_bytes())
    (root / "team" / "ok").mkdir()
    (root / "team" / "ok" / "params.yaml").write_bytes(src.read_bytes())

    before_s3, before_local = snapshot_s3(world), snapshot_local(root)
    since = s3.offset()
    http = httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.key}"}, timeout=120)
    statuses: list[int] = []
    jobs: dict[str, str] = {}  # job id -> what it tried

    # Positive controls first (they also warm the worker up for the dry runs below): the key
    # works inside its prefixes, on S3 and locally.
    with svc.client() as c:
        for what, body in (
            ("ok s3", _simulate(f"{team_s3}/ok/params.yaml", f"{team_s3}/ok/model")),
            ("ok local", _simulate(f"{team_local}/ok/params.yaml", f"{team_local}/ok/model")),
        ):
            job = final(c, c._request("POST", "/v1/jobs", json=body).json()["id"])
            assert job["state"] == "succeeded", (what, job.get("error"))
            assert job["result"]["checkpoints"]

    # 1. Every URI-bearing request field, with every spelling of an escape: refused at once.
    fields: dict[str, Any] = {
        "source": lambda u: {"kind": "convert", "source": {"uri": u}, "target": _t(team_s3 + "/o.mdl")},
        "target": lambda u: {"kind": "convert", "source": {"uri": team_s3 + "/in.safetensors"}, "target": _t(u)},
        "config": lambda u: {
            "kind": "convert-model",
            "source": {"uri": team_s3 + "/m.mdl"},
            "options": {"model": "gpt2", "src_fmt": "cs-1.9", "tgt_fmt": "cs-2.9", "config": u},
        },
        "hf": lambda u: {
            "kind": "verify",
            "source": {"uri": team_s3 + "/m.mdl"},
            "options": {"hf": u, "config": team_s3 + "/c.yaml", "model": "llama"},
        },
        "model_dir": lambda u: _simulate(team_s3 + "/p.yaml", u),
        "checkpoint": lambda u: {
            "kind": "simulate",
            "source": {"uri": team_s3 + "/p.yaml"},
            "options": {"model_dir": team_s3 + "/m", "checkpoint": u},
        },
        "iter_dir": lambda u: {
            "kind": "dataloader-state",
            "source": {"uri": team_s3 + "/m.mdl"},
            "target": _t(team_s3 + "/o.mdl"),
            "options": {"iter_dir": u},
        },
    }
    for field, body in fields.items():
        for uri in escapes(world, "x.mdl"):
            for path in ("/v1/jobs", "/v1/plans"):
                r = http.post(path, json=body(uri))
                statuses.append(r.status_code)
                assert r.status_code in (403, 422), (field, uri, path, r.status_code, r.text)
                assert r.json()["code"] in REFUSED | {"validation_error"}, (field, uri, r.text)
    for uri in escapes(world, "x.mdl"):
        r = http.get("/v1/inspect", params={"uri": uri})
        statuses.append(r.status_code)
        assert r.status_code in (403, 422) and r.json()["code"] in REFUSED, (uri, r.text)

    # convert-model from 1.9: the old config's cerebras.save_iter_state_path names dataloader files.
    # Dry runs first (they read the same config), while the worker is idle.
    old = tmp_path / "checkpoint_10.mdl"
    write_checkpoint(str(old), _gpt2_cs_state(""), cstorch_version="1.9.0")
    put(world, "team/old/checkpoint_10.mdl", old.read_bytes())
    upgrades = []
    for i, uri in enumerate([canary["s3_iters"], canary["local_iters"], f"{root}/team/../secret/iter_state"]):
        doc = {
            **LEGACY_GPT2,
            "cerebras": {"save_iter_state_path": uri},
            "train_input": {"data_processor": "GptHDF5MapDataProcessor"},
        }
        put(world, f"team/old/params{i}.yaml", yaml.safe_dump(doc).encode())
        options = {"model": "gpt2", "src_fmt": "cs-1.9", "tgt_fmt": "cs-2.9", "config": f"{team_s3}/old/params{i}.yaml"}
        body = {
            "kind": "convert-model",
            "source": {"uri": f"{team_s3}/old/checkpoint_10.mdl"},
            "target": {"uri": f"{team_s3}/old/out{i}/", "format": "cs-h5"},
            "options": options,
        }
        upgrades.append((uri, body))
        r = http.post("/v1/plans", json=body)
        statuses.append(r.status_code)
        assert r.status_code in (403, 422) and r.json()["code"] in REFUSED, (uri, r.text)

    # 2. URIs inside the user's own files, run as jobs to their end.
    def submit(what: str, body: dict[str, Any]) -> None:
        r = http.post("/v1/jobs", json=body)
        statuses.append(r.status_code)
        assert r.status_code == 202, (what, r.text)
        jobs[r.json()["id"]] = what

    for uri, body in upgrades:
        submit(f"save_iter_state_path={uri}", body)

    # simulate: the config's checkpoint_root names where checkpoints go.
    for i, uri in enumerate(escapes(world, "ckpts")):
        if uri == f"s3://{b}/team":  # checkpoints go *under* a root: s3://b/team/… is inside
            continue
        cfg = trainer_config(checkpoint={"steps": 1, "checkpoint_root": uri}, max_steps=1)
        put(world, f"team/root{i}/params.yaml", yaml.safe_dump(cfg).encode())
        submit(f"checkpoint_root={uri}", _simulate(f"{team_s3}/root{i}/params.yaml", f"{team_s3}/root{i}/model"))
    cfg = trainer_config(checkpoint={"steps": 1, "checkpoint_root": str(root / "secret" / "ckpts")}, max_steps=1)
    (root / "team" / "local-root").mkdir()
    (root / "team" / "local-root" / "params.yaml").write_text(yaml.safe_dump(cfg))
    submit("local checkpoint_root", _simulate(f"{team_local}/local-root/params.yaml", f"{team_local}/local-root/m"))

    # simulate: checkpoints_index.yaml in the user's own model dir lists checkpoints elsewhere
    # (the trainer probes each with exists() and autoloads the last).
    entries = [canary["s3_ckpt"], canary["other_bucket_ckpt"], canary["local_ckpt"], f"s3://{b}/team"]
    for i, entry in enumerate(entries):
        put(world, f"team/idx{i}/model/checkpoints_index.yaml", yaml.safe_dump([entry]).encode())
        submit(f"index entry {entry}", _simulate(f"s3://{b}/team/ok/params.yaml", f"{team_s3}/idx{i}/model"))
        d = root / "team" / f"idx{i}" / "model"
        d.mkdir(parents=True)
        (d / "checkpoints_index.yaml").write_text(yaml.safe_dump([entry]))
        submit(f"local index entry {entry}", _simulate(f"{team_local}/ok/params.yaml", str(d)))

    # safetensors shard maps naming shards outside the checkpoint's directory.
    for i, shard in enumerate(["../../team2/canary.mdl", f"s3://{b}/team2/canary.mdl", "/etc/passwd", "%2e%2e/x"]):
        index = {"metadata": {}, "weight_map": {"w": shard}}
        put(world, f"team/st{i}/model.safetensors.index.json", json.dumps(index).encode())
        submit(
            f"shard {shard}",
            {"kind": "convert", "source": {"uri": f"{team_s3}/st{i}/"}, "target": _t(f"{team_s3}/st{i}-out.mdl")},
        )

    with svc.client() as c:
        results = {job_id: final(c, job_id) for job_id in jobs}
    accessed = s3.requests(since)

    for job_id, job in results.items():
        what = jobs[job_id]
        assert job["state"] == "failed", (what, job["state"], job.get("result"))
        assert job["error"]["code"] in REFUSED, (what, job["error"])
    assert all(s < 500 for s in statuses)

    # Nothing outside the prefixes was asked of the store: every request names a key (or a
    # listing prefix) under team/ of the one bucket.
    outside = []
    for method, bucket, key, query in accessed:
        named = key or (query.get("prefix") or [""])[0]
        if bucket != b or not named.startswith("team/"):
            outside.append((method, bucket, key, query))
    assert not outside, outside
    assert any(key.startswith("team/ok/model/") for _, _, key, _ in accessed)  # the control did write

    # Nothing outside the prefixes changed, locally or on S3.
    after_s3 = snapshot_s3(world)
    assert {k: v for k, v in after_s3.items() if not k[1].startswith("team/") or k[0] != b} == {
        k: v for k, v in before_s3.items() if not k[1].startswith("team/") or k[0] != b
    }
    assert snapshot_local(root) == before_local
    assert not (root / "secret" / "ckpts").exists()


def _t(uri: str) -> dict[str, str]:
    return {"uri": uri, "format": "cs-h5"}


def _simulate(config: str, model_dir: str) -> dict[str, Any]:
    return {"kind": "simulate", "source": {"uri": config}, "options": {"model_dir": model_dir}}
