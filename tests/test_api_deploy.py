"""What can be checked of the deployment files without Docker: the commands the image and the
compose file run exist and start, the image runs as a non-root user with the pinned CPU torch, and
the package ships its data files (the image installs it non-editable)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from ckptconv.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _json_list(line: str) -> list[str]:
    import json

    return json.loads(line.split(None, 1)[1])


def test_image_entrypoint_and_default_command_parse() -> None:
    text = _dockerfile()
    (entry,) = [_json_list(line) for line in text.splitlines() if line.startswith("ENTRYPOINT")]
    (cmd,) = [_json_list(line) for line in text.splitlines() if line.startswith("CMD")]
    assert entry == ["ckptconv"]
    args = build_parser().parse_args(cmd)
    assert args.func.__name__ == "cmd_serve" and args.host == "0.0.0.0"


def test_image_runs_as_a_non_root_user_with_the_pinned_cpu_torch() -> None:
    text = _dockerfile()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    pin = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    )
    # Dependencies come from the hashed lock, whose torch is the pinned release's CPU build (served by
    # PyTorch's CPU index; the default wheel pulls CUDA).
    install = "pip install --require-hashes -r requirements.lock --extra-index-url https://download.pytorch.org/whl/cpu"
    assert "COPY requirements.lock ./" in text and install in text
    lock = (ROOT / "requirements.lock").read_text()
    assert re.search(rf"^{re.escape(pin)}\+cpu \\\n\s+--hash=sha256:[0-9a-f]{{64}}", lock, re.M), pin
    # Every directory the package needs is copied into the image.
    for package in ("ckptconv", "service", "worker"):
        assert f"COPY {package} ./{package}" in text


def test_compose_services_run_valid_commands_on_one_network() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"api", "worker", "redis", "minio", "minio-setup"} <= set(services)
    parser = build_parser()
    assert parser.parse_args(services["api"]["command"]).func.__name__ == "cmd_serve"
    assert parser.parse_args(services["worker"]["command"]).func.__name__ == "cmd_worker"
    # Conversions and interactive work (plans, inspections, webhooks) have their own consumers.
    assert parser.parse_args(services["worker"]["command"]).queues == "jobs"
    assert parser.parse_args(services["interactive"]["command"]).interactive
    env = services["api"]["environment"]
    assert env["CKPTCONV_REDIS_URL"].startswith("redis://redis:")
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert "local/checkpoints" in " ".join(services["minio-setup"]["entrypoint"])
    assert env["CKPTCONV_STORAGE_PROBE_URI"] == "s3://checkpoints/"


def test_serve_and_worker_commands_start(tmp_path: Path) -> None:
    # `--help` builds every parser and imports nothing heavy; `worker --help` proves Celery's CLI loads.
    for args in (["serve", "--help"], ["worker", "--help"]):
        out = subprocess.run([sys.executable, "-m", "ckptconv", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr


def test_wheel_ships_the_layout_tables(tmp_path: Path) -> None:
    import shutil
    import zipfile

    # Build from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("ckptconv", "service", "worker"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=src,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("ckptconv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tables = sorted(p.name for p in (ROOT / "ckptconv" / "engine" / "layouts" / "families").glob("*.yaml"))
    shipped = sorted(
        n.rsplit("/", 1)[1] for n in names if n.startswith("ckptconv/engine/layouts/families/") and n.endswith(".yaml")
    )
    assert tables and shipped == tables
