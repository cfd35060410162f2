"""The dependency locks (``scripts/lock.sh``) say what ``pyproject.toml`` asks for, hashed, consistently.

``make setup`` and CI install ``requirements-test.lock``, the Dockerfile ``requirements.lock``; a lock
that misses a dependency, a hash, or disagrees with the other would install something untested.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(name: str) -> dict[str, tuple[str, int]]:
    """package -> (version, number of hashes)."""
    pins: dict[str, tuple[str, int]] = {}
    current = None
    for line in (ROOT / name).read_text().splitlines():
        m = _PIN.match(line)
        if m:
            current = _norm(m.group(1))
            pins[current] = (m.group(2), 0)
        elif line.strip().startswith("--hash=sha256:") and current is not None:
            version, n = pins[current]
            pins[current] = (version, n + 1)
        elif line and not line.startswith(" "):
            current = None
    return pins


def requirement_names(reqs: list[str]) -> set[str]:
    return {_norm(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in reqs}


def test_locks_cover_pyproject_with_hashes_and_agree() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime, test = read_lock("requirements.lock"), read_lock("requirements-test.lock")
    assert requirement_names(project["dependencies"]) <= set(runtime)
    assert requirement_names(project["dependencies"] + project["optional-dependencies"]["test"]) <= set(test)
    for lock in (runtime, test):
        assert all(n > 0 for _, n in lock.values()), [k for k, (_, n) in lock.items() if not n]
        assert lock["torch"][0] == "2.13.0+cpu"  # the CPU wheel this project is tested with
        assert "setuptools" in lock  # the build backend: the project installs with --no-build-isolation
    assert {k: v[0] for k, v in runtime.items()} == {k: test[k][0] for k in runtime}  # same versions


def test_setup_and_docker_install_from_the_locks() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--require-hashes" in setup and "requirements-test.lock" in setup and "requirements.lock" in setup
    docker = (ROOT / "Dockerfile").read_text()
    assert "--require-hashes -r requirements.lock" in docker
