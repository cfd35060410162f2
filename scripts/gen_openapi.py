#!/usr/bin/env python3
"""Write openapi/openapi.json from the application (or, with --check, fail if it differs).

.venv/bin/python scripts/gen_openapi.py          # regenerate after changing the API
.venv/bin/python scripts/gen_openapi.py --check  # what CI runs (tests/test_api_openapi.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "openapi" / "openapi.json"


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from ckptconv.core.settings import Settings
    from service.app import create_app

    # The document does not depend on settings; development mode only avoids needing secrets.
    app = create_app(Settings(environment="development"))
    return json.dumps(app.openapi(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if openapi/openapi.json is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run scripts/gen_openapi.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
