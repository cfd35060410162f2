# The commands README.md gives: `make demo` runs the main job, `make test` runs the tests.
.PHONY: setup test lint demo bench lock

setup:
	scripts/setup.sh test

lint: setup
	.venv/bin/ruff check .
	.venv/bin/lint-imports

# --durations=30: every log names the slowest tests (the suite is meant to stay under 20 minutes on 2 cores).
test: setup
	scripts/setup-tf-oracle.sh >/dev/null
	scripts/setup-browser.sh
	.venv/bin/ruff check .
	.venv/bin/lint-imports
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 $(PYTEST_ARGS)

demo:
	scripts/setup.sh
	scripts/demo.sh

bench: setup
	.venv/bin/python -m bench.convert_bench

# Regenerate requirements.lock and requirements-test.lock (pinned, hashed) after pyproject.toml changes.
lock:
	scripts/lock.sh
