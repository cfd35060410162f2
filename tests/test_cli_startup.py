"""What a command loads before its first byte moves: a command imports the modules it uses, not
every command's (``ckptconv convert`` of local files pays for no HTTP client, no Redis client, no
model tables and no fan-out machinery)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent

# Modules of other commands: the service's clients (HTTP, Redis), the model layouts (their YAML tables
# are read and validated when imported), and the fan-out of a job over workers.
NOT_FOR_A_LOCAL_CONVERT = (
    "httpx",
    "redis",
    "ckptconv.client",
    "ckptconv.core.jobstore",
    "ckptconv.engine.layouts.families",
    "ckptconv.engine.layouts.tables",
    "ckptconv.engine.fanout.run",
)


def _loaded_after(argv: list[str]) -> list[str]:
    """The modules of ``NOT_FOR_A_LOCAL_CONVERT`` loaded once ``ckptconv ARGV`` ran, in a fresh interpreter."""
    code = (
        "import json, sys\n"
        "from ckptconv.cli.main import main\n"
        f"rc = main({argv!r})\n"
        f"print(json.dumps([rc, sorted(m for m in {NOT_FOR_A_LOCAL_CONVERT!r} if m in sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    rc, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0, out.stdout + out.stderr
    return loaded


def test_a_local_convert_imports_only_what_it_uses(tmp_path: Path) -> None:
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(tmp_path / "a.safetensors"))
    argv = ["convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.mdl"), "--to", "cs-h5", "--no-progress"]
    assert _loaded_after(argv) == []
    assert (tmp_path / "b.mdl").exists()
