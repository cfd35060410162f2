"""The command line's job commands are generated from the kinds' options models: every option has a
flag, every default is the model's, and an option added to a model is a flag without more code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic import Field

from ckptconv.cli.kind_flags import ALIASES, add_kind_flags, dest, flags_of, kind_options
from ckptconv.cli.main import build_parser, main
from ckptconv.core.errors import InvalidRequest
from ckptconv.jobs.kinds import KINDS, KindOptions, Size, job_kind

# Each kind's command, with the least it needs to parse (its required options get stand-in values).
COMMANDS = {
    "convert": ["convert", "src", "dst"],
    "convert-model": ["convert-model", "src", "--model", "llama", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9"],
    "verify": ["verify", "--cs", "c.mdl", "--hf", "hf/", "--config", "c.yaml", "--model", "llama"],
    "simulate": ["simulate", "--config", "c.yaml", "--model-dir", "run/"],
    "fix-spec": ["fix-spec", "old.mdl"],
    "dataloader-state": ["convert-dataloader-state", "-c", "c.mdl", "-w", "iter/", "-o", "out.mdl"],
}


def _option_strings(argv: list[str]) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for action in sub.choices[argv[0]]._actions for s in action.option_strings}


def test_every_kind_has_a_command() -> None:
    assert set(COMMANDS) == set(KINDS)


@pytest.mark.parametrize("kind_name", sorted(COMMANDS))
def test_every_option_has_a_flag_and_the_models_default(kind_name: str) -> None:
    argv = COMMANDS[kind_name]
    args = build_parser().parse_args(argv)
    offered = _option_strings(argv)
    model = KINDS[kind_name].options
    for option, info in model.model_fields.items():
        alias = ALIASES.get((kind_name, option))
        if alias is not None and alias.fixed:
            continue  # set by the command itself, named in the one table of exceptions
        for name in flags_of(kind_name, option).split("/"):
            assert name in offered, f"{kind_name}.{option}: no flag {name} on `ckptconv {argv[0]}`"
        if not info.is_required():
            assert getattr(args, dest(kind_name, option)) == info.default, f"{kind_name}.{option}: default differs"
    # The options the command runs with are the model's own defaults where nothing was given.
    options = kind_options(args, kind_name)
    for option, info in model.model_fields.items():
        alias = ALIASES.get((kind_name, option))
        if not info.is_required() and not (alias and alias.fixed):
            assert getattr(options, option) == info.default


def test_an_option_added_to_a_model_is_a_flag() -> None:
    @job_kind("cli-kinds-probe")
    class ProbeOptions(KindOptions):
        """A kind that exists only in this test."""

        parallelism: int | None = Field(default=None, gt=0, le=64, description="tensors written at once")
        mode: Literal["fast", "careful"] = Field(default="careful", description="how to go")
        fold: bool = Field(default=True, description="fold things")
        chunk: Size | None = Field(default="1GB", description="largest chunk")

    try:
        parser = argparse.ArgumentParser(prog="probe")
        add_kind_flags(parser, "cli-kinds-probe")
        defaults = parser.parse_args([])
        assert getattr(defaults, dest("cli-kinds-probe", "chunk")) == "1GB"
        assert getattr(defaults, dest("cli-kinds-probe", "fold")) is True
        given = parser.parse_args(["--parallelism", "4", "--mode", "fast", "--no-fold", "--chunk", "5MB"])
        assert kind_options(given, "cli-kinds-probe") == ProbeOptions(
            parallelism=4, mode="fast", fold=False, chunk="5MB"
        )
        text = parser.format_help()
        assert "tensors written at once (> 0, <= 64)" in text and "{fast,careful}" in text
        # Values are checked by the model: one typed error naming the flag.
        for bad, flag in ((["--parallelism", "0"], "--parallelism"), (["--mode", "slow"], "--mode")):
            with pytest.raises(InvalidRequest, match=flag):
                kind_options(parser.parse_args(bad), "cli-kinds-probe")
    finally:
        del KINDS["cli-kinds-probe"]


def test_a_value_the_model_refuses_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*COMMANDS["verify"], "--batch-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "[invalid_request]" in err and "--batch-size: Input should be greater than 0" in err
    assert main([*COMMANDS["convert"], "--to", "safetensors", "--dtype", "int8"]) == 2
    assert "--dtype: Input should be" in capsys.readouterr().err


def test_dtype_shorthands_are_the_models_values() -> None:
    args = build_parser().parse_args([*COMMANDS["convert"], "--dtype", "BF16"])
    assert kind_options(args, "convert").dtype == "bfloat16"


def test_the_engines_python_defaults_are_the_kinds() -> None:
    # The engine's functions are a Python API of their own (`ckptconv.convert_model(...)`), below the
    # kinds, so they keep their defaults; this keeps them equal to the options models'.
    import inspect

    from ckptconv.engine.convert import convert
    from ckptconv.engine.layouts.api import convert_model
    from ckptconv.engine.legacy.dataloader_state import convert_dataloader_state
    from ckptconv.engine.run import verify_mode
    from ckptconv.engine.simulator.trainer import simulate
    from ckptconv.engine.simulator.verify import verify

    engine = {
        "convert": convert,
        "convert-model": convert_model,
        "verify": verify,
        "simulate": simulate,
        "dataloader-state": convert_dataloader_state,
    }
    renamed = {("simulate", "checkpoint"): "ckpt_path"}
    other_meaning = {("convert-model", "verify")}  # the engine's `verify` there is the container check
    compared = 0
    for kind_name, function in engine.items():
        params = inspect.signature(function).parameters
        for option, info in KINDS[kind_name].options.model_fields.items():
            name = renamed.get((kind_name, option), option)
            if name not in params or (kind_name, option) in other_meaning or info.is_required():
                continue
            default = params[name].default
            if (kind_name, option) == ("convert", "verify"):
                default = verify_mode(default)
            assert default == info.default, f"{kind_name}.{option}: engine {default!r}, model {info.default!r}"
            compared += 1
    assert compared >= 20


def test_a_models_own_check_keeps_its_typed_error(capsys: pytest.CaptureFixture[str]) -> None:
    # The options model checks a model name with the layout registry; its error keeps code and hint.
    argv = ["convert-model", "x.safetensors", "--model", "no-such-model", "--src-fmt", "hf", "--tgt-fmt", "cs-2.9"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "[unknown_model]" in err and "ckptconv models" in err


def test_local_switches_reach_the_handler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What only a local run offers goes to the same handler a worker runs, as ctx.local.
    import yaml
    from safetensors.torch import save_file
    from test_simulator_trainer import config

    src = str(tmp_path / "w.safetensors")
    save_file({"w": torch.arange(16, dtype=torch.float32).reshape(4, 4)}, src)
    base = ["convert", src, "--to", "cs-h5", "--json", "--no-progress"]
    assert main([*base[:2], str(tmp_path / "a.mdl"), *base[2:], "--no-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["verify"]["skipped"] is True
    assert main([*base[:2], str(tmp_path / "b.mdl"), *base[2:], "--full-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["verify"]["mode"] == "full"

    cfg = tmp_path / "params.yaml"
    cfg.write_text(yaml.safe_dump(config(checkpoint={"steps": 2}, max_steps=9)))
    argv = ["simulate", "--config", str(cfg), "--model-dir", str(tmp_path / "run"), "--stop-after", "3", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["interrupted"] and result["global_step"] == 3
    assert [o["uri"].rsplit("/", 1)[-1] for o in result["outputs"]] == ["checkpoint_2.mdl"]


def test_original_switches_set_the_models_values() -> None:
    args = build_parser().parse_args([*COMMANDS["verify"], "--non-strict"])
    options = kind_options(args, "verify")
    assert options.strict is False and options.fail_on_mismatch is False  # the exit status is the verdict
    args = build_parser().parse_args([*COMMANDS["convert-model"], "--no-fold-mup", "--hf-shard-size", "2GB"])
    options = kind_options(args, "convert-model")
    assert options.fold_mup is False and options.hf_shard_size == "2GB"


def test_h5_compression_flag_chooses_the_h5_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import h5py
    from safetensors.torch import save_file

    src = str(tmp_path / "w.safetensors")
    save_file({"w": torch.zeros(512, 1024), "b": torch.arange(16, dtype=torch.float32)}, src)
    base = ["convert", src, "--to", "cs-h5", "--no-progress"]
    assert main([*base[:2], str(tmp_path / "a.mdl"), *base[2:]]) == 0
    assert main([*base[:2], str(tmp_path / "b.mdl"), *base[2:], "--h5-compression", "lz4"]) == 0
    with h5py.File(tmp_path / "a.mdl", "r") as a, h5py.File(tmp_path / "b.mdl", "r") as b:
        for name in ("w", "b"):
            assert a[name].chunks is None and a[name].id.get_create_plist().get_nfilters() == 0
            assert b[name].chunks is not None and b[name].id.get_create_plist().get_filter(0)[0] == 32004
        assert b["w"].id.get_storage_size() < a["w"].id.get_storage_size() / 100  # zeros compress
    # Another target format has no H5 layout: refused, typed.
    assert main(["convert", src, str(tmp_path / "c"), "--to", "safetensors", "--h5-compression", "lz4"]) == 2
    assert "h5_compression applies to cs-h5 outputs" in capsys.readouterr().err
