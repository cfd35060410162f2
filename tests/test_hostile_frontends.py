"""The attack corpus (tests/attacks) through every front end: the API (inspections and dry runs
answered by a real worker), jobs run by that worker, and the CLI.

Whatever a file does, each front end answers with a typed error: never a 5xx, never
``internal_error``, never a traceback. Conversions fail with exactly the error the engine-level
corpus tests expect (``EXPECTED`` of each generator); inspections and dry runs read metadata only,
so a file whose damage shows only when tensor data is read may pass them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_e2e_service import Service, bucket  # noqa: F401 - bucket is a fixture the service needs

from ckptconv.cli.main import main as cli
from ckptconv.core import errors

ATTACKS = Path(__file__).resolve().parent / "attacks"
sys.path.insert(0, str(ATTACKS))
import make_h5_attacks  # noqa: E402
import make_tensor_attacks  # noqa: E402
import make_tf_attacks  # noqa: E402

CORPUS: dict[str, tuple[str | None, str]] = {
    **make_h5_attacks.EXPECTED,
    **make_tensor_attacks.EXPECTED,
    **make_tf_attacks.EXPECTED,
}


def expected_code(name: str) -> str | None:
    error = CORPUS[name][0]
    return None if error is None else getattr(errors, error).code


def conversion(name: str) -> tuple[str, str | None]:
    """(target format, source format) of the conversion each family is tried with."""
    if name.startswith("h5_"):
        return "safetensors", "cs-h5"
    if name.startswith("st_"):
        return "cs-h5", "safetensors"
    if name.startswith("tf_"):
        return "safetensors", "tf"
    return "safetensors", "torch"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile").resolve()
    data = root / "data"
    data.mkdir()
    for name in CORPUS:
        src = ATTACKS / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, data / name)
    return root


@pytest.fixture(scope="module")
def service(redis_url: str, bucket: str, corpus: Path) -> Iterator[Service]:  # noqa: F811
    (corpus / "svc").mkdir()
    # The corpus is a burst of requests from one key: no rate limit here.
    burst = {"CKPTCONV_RATE_LIMIT_PER_SECOND": "0"}
    svc = Service(redis_url, bucket, corpus / "svc", prefixes=[f"{corpus}/data/"], env=burst, workers=1)
    try:
        yield svc
    finally:
        svc.stop()


def _typed(response: httpx.Response, name: str, what: str) -> dict[str, Any]:
    assert response.status_code < 500, (name, what, response.status_code, response.text)
    doc = response.json()
    if response.status_code >= 400:
        assert doc["code"] != "internal_error" and doc["code"] in errors._BY_CODE, (name, what, doc)
        want = expected_code(name)
        assert doc["code"] == want, (name, what, doc, want)
    return doc


def _yaml_bomb() -> str:
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def _answered(http: httpx.Client, uri: str) -> bool:
    try:
        return http.get("/v1/inspect", params={"uri": uri}).status_code < 500
    except httpx.TransportError:
        return False


def _convert(source: str, fmt: str | None, target: str, to: str) -> dict[str, Any]:
    return {"kind": "convert", "source": {"uri": source, "format": fmt}, "target": {"uri": target, "format": to}}


def test_attack_corpus_through_the_api_and_the_worker(service: Service, corpus: Path) -> None:
    data = corpus / "data"
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.key}"}, timeout=120)

    # A fresh worker's first answers wait for its imports (torch's legacy loader takes seconds),
    # longer than the API waits on Redis under load: let each reader warm up outside the corpus.
    for warm in ("h5_bytes_exec.mdl", "st_hole.safetensors", "torch_exec_legacy.pt"):
        deadline = time.monotonic() + 180
        while not _answered(http, str(data / warm)):
            assert time.monotonic() < deadline, "the worker never answered an inspection"

    # Inspections and dry runs first (their interactive queue is shared with the jobs below).
    for name in sorted(CORPUS):
        to, fmt = conversion(name)
        uri = str(data / name)
        _typed(http.get("/v1/inspect", params={"uri": uri, "format": fmt}), name, "inspect")
        _typed(http.post("/v1/plans", json=_convert(uri, fmt, f"{uri}.plan", to)), name, "plan")

    jobs = {}
    for name in sorted(CORPUS):
        to, fmt = conversion(name)
        uri = str(data / name)
        r = http.post("/v1/jobs", json=_convert(uri, fmt, f"{uri}.out", to))
        assert r.status_code == 202, (name, r.text)
        jobs[name] = r.json()["id"]
    # Configs are user files too: nested past the recursion limit, or an alias bomb.
    configs = {"deep.yaml": "a: " + "[" * 20_000 + "]" * 20_000, "bomb.yaml": _yaml_bomb()}
    config_jobs = {}
    for name, text in configs.items():
        (data / name).write_text(text)
        body = {"kind": "simulate", "source": {"uri": str(data / name)}, "options": {"model_dir": str(data / "m")}}
        r = http.post("/v1/jobs", json=body)
        assert r.status_code == 202, (name, r.text)
        config_jobs[name] = r.json()["id"]
    with service.client() as c:
        for name, job_id in config_jobs.items():
            job = c.wait(job_id, timeout=300)
            # A run config that cannot be read is refused as such, by the simulator as by model conversion.
            code = job["error"]["code"] if job["state"] == "failed" else None
            assert code == "config_conversion_error", (name, job.get("error"))
        for name, job_id in jobs.items():
            job = c.wait(job_id, timeout=300)
            want = expected_code(name)
            if want is None:
                assert job["state"] == "succeeded", (name, job.get("error"))
            else:
                assert job["state"] == "failed" and job["error"]["code"] == want, (name, job.get("error"))
                # Nothing partial at the target (the job's record is mirrored beside it, as for every job).
                left = [p for p in data.glob(name + ".out*") if not p.name.endswith(".ckptconv-job.json")]
                assert not left, (name, left)
        # A model conversion whose source cannot be read fails typed; its cleanup, which would
        # read the source again to name the target, says so in one line.
        options = {"model": "llama", "src_fmt": "cs-2.9", "tgt_fmt": "hf"}
        body = {"kind": "convert-model", "source": {"uri": str(data / "h5_truncated.mdl")}, "options": options}
        r = http.post("/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        job = c.wait(r.json()["id"], timeout=300)
        assert job["state"] == "failed" and job["error"]["code"] == "corrupt_checkpoint", job.get("error")
    # Every failure above was typed: the worker logged no traceback.
    for log in (corpus / "svc").glob("worker-*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_attack_corpus_through_the_cli(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    to, fmt = conversion(name)
    src = str(ATTACKS / name)
    want = expected_code(name)
    for argv, reads_data in (
        (["inspect", src, "--from", fmt], False),
        (["convert", src, str(tmp_path / "out"), "--to", to, "--from", fmt, "--no-progress"], True),
    ):
        rc = cli(argv)
        err = capsys.readouterr().err
        assert rc in (0, 2), (name, argv, err)
        if rc == 2:
            assert f"[{want}]" in err, (name, argv, err)
        elif reads_data:
            assert want is None, (name, argv, "converted a file that must be refused")


def test_a_deeply_nested_header_is_a_typed_error_in_a_cli_process(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckptconv", "inspect", str(ATTACKS / "st_deep_metadata.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "[corrupt_checkpoint]" in out.stderr and "Traceback" not in out.stderr, out.stderr
