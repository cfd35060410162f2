"""The committed OpenAPI document is the one the code serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_openapi_matches_the_code() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/gen_openapi.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr + "\nregenerate with: .venv/bin/python scripts/gen_openapi.py"


def test_every_error_response_is_a_problem_document() -> None:
    import json

    doc = json.loads((ROOT / "openapi" / "openapi.json").read_text())
    assert "Problem" in doc["components"]["schemas"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for code, response in op["responses"].items():
                if int(code) >= 400:
                    assert list(response["content"]) == ["application/problem+json"], (path, method, code)
