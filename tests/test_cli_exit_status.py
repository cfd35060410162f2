"""The CLI's exit statuses stay distinguishable: 1 is an answer (`diff`: they differ), 2 a typed
error, 70 an unexpected exception (a bug), never Python's default 1 with a traceback."""

from __future__ import annotations

import uuid

import pytest
import torch
from safetensors.torch import save_file

import ckptconv.engine.diff as engine_diff
from ckptconv.cli.main import EXIT_ERROR, EXIT_INTERNAL_ERROR, main


@pytest.fixture
def pair(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.zeros(4)}, str(a))
    save_file({"w": torch.ones(4)}, str(b))
    return str(a), str(b)


def test_diff_answers_one_when_checkpoints_differ(pair, capsys):
    assert main(["diff", pair[0], pair[0]]) == 0
    assert main(["diff", *pair]) == 1


def test_typed_error_exits_two(pair, tmp_path, capsys):
    assert main(["diff", pair[0], str(tmp_path / "missing.safetensors")]) == EXIT_ERROR
    assert "error [" in capsys.readouterr().err


def test_unexpected_exception_is_not_mistaken_for_an_answer(pair, capsys, monkeypatch):
    def broken(*args, **kwargs):  # fault injection: a bug inside the engine
        raise RuntimeError("injected")

    monkeypatch.setattr(engine_diff, "diff_checkpoints", broken)  # `diff` imports it when it runs
    assert main(["diff", *pair]) == EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "error [internal_error]: RuntimeError: injected" in err
    assert "Traceback" not in err
    monkeypatch.setenv("CKPTCONV_TRACEBACK", "1")
    assert main(["diff", *pair]) == EXIT_INTERNAL_ERROR
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rtol", "--atol"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_tolerance_that_is_no_tolerance_is_a_typed_error(pair, capsys, flag, value):
    argv = ["diff", *pair, "--tensor_comparison_op", "allclose", flag, value]
    assert main(argv) == EXIT_ERROR
    assert "error [invalid_request]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", [["keys", "list"], ["keys", "create", "--name", "ops", "--prefix", "s3://b/"], ["keys", "revoke", "k1"]]
)
def test_an_unreachable_redis_is_a_typed_error_of_the_key_commands(capsys, monkeypatch, command):
    # Port 1 on loopback: nothing listens there, so the connection is refused at once.
    monkeypatch.setenv("CKPTCONV_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("CKPTCONV_ENVIRONMENT", "development")
    assert main(command) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "error [service_unavailable]" in err and "redis://127.0.0.1:1/0" in err


@pytest.mark.parametrize(
    "command", [["keys", "list"], ["keys", "create", "--name", "ops", "--prefix", "s3://b/"], ["keys", "revoke", "k1"]]
)
def test_a_redis_that_fails_the_key_command_itself_is_a_typed_error(capsys, monkeypatch, redis_url, command):
    """Redis answers the first PING, then refuses the command (here: a user allowed nothing but
    PING; the same path as a Redis that went away in between): still service_unavailable."""
    import redis

    admin = redis.Redis.from_url(redis_url)
    user, password = f"ckptconv-ping-only-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], commands=["+ping"], keys=["*"])
    try:
        host_and_db = redis_url.split("://", 1)[1]
        monkeypatch.setenv("CKPTCONV_REDIS_URL", f"redis://{user}:{password}@{host_and_db}")
        monkeypatch.setenv("CKPTCONV_ENVIRONMENT", "development")
        assert main(command) == EXIT_ERROR
        err = capsys.readouterr().err
        assert "error [service_unavailable]" in err and "Traceback" not in err
        assert password not in err  # the URL is named without its secret
    finally:
        admin.acl_deluser(user)
        admin.close()
