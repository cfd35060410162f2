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
    # HDF5's filter plugins: an uncompressed cs-h5 output uses none (they load nine shared libraries).
    "hdf5plugin",
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


def test_lz4_files_are_written_and_read_back_by_a_fresh_interpreter(tmp_path: Path) -> None:
    # The LZ4 filter is registered with HDF5 where it is used, not at import: an LZ4 output (its
    # small tensors made by h5py with the filter) and the reading of one, each in a process that
    # loaded nothing else first.
    tensors = {"big": np.arange(1 << 16, dtype=np.float32).reshape(256, 256), "small": np.ones(3, np.float32)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    lz4 = str(tmp_path / "b.mdl")
    for argv in (
        ["convert", str(tmp_path / "a.safetensors"), lz4, "--to", "cs-h5", "--h5-compression", "lz4", "--no-progress"],
        ["diff", str(tmp_path / "a.safetensors"), lz4],
    ):
        code = f"import sys\nfrom ckptconv.cli.main import main\nsys.exit(main({argv!r}))\n"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
