"""The in-process Python API: ``from ckptconv import convert, convert_model, inspect, plan``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_llama

import ckptconv
from ckptconv import CkptconvError, ConvertResult, Progress, convert, convert_model, diff, inspect, plan, plan_model

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")


def test_the_api_is_the_engine_the_cli_calls() -> None:
    from ckptconv.engine import convert as engine_convert
    from ckptconv.engine.layouts import api

    assert convert is engine_convert.convert and inspect is engine_convert.inspect
    assert plan is engine_convert.plan_conversion and convert_model is api.convert_model
    assert plan_model is api.plan_model
    with pytest.raises(AttributeError):
        _ = ckptconv.nope


def test_importing_ckptconv_stays_light() -> None:
    code = (
        "import sys, ckptconv; "
        "assert not [m for m in sys.modules if m.startswith(('ckptconv.engine', 'torch'))], 'eager import'; "
        "from ckptconv import convert; assert 'ckptconv.engine.convert' in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_convert_with_progress_and_cancel(tmp_path: Path) -> None:
    src = tmp_path / "w.safetensors"
    save_file({f"layer.{i}.weight": torch.randn(64, 64) for i in range(8)}, src)
    seen: list[Progress] = []
    result = convert(str(src), str(tmp_path / "w.mdl"), to="cs-h5", progress=seen.append)
    assert isinstance(result, ConvertResult) and result.verify["ok"] and result.tensors == 8
    stages = [p.stage for p in seen]
    assert "converting" in stages and "verifying" in stages and stages[-1] == "done"
    done = max((p for p in seen if p.stage == "converting"), key=lambda p: p.bytes_done)
    assert done.bytes_done == done.bytes_total == 8 * 64 * 64 * 4
    last = seen[-1]  # a finished job's last report reads full, not zero
    assert (last.tensors_done, last.bytes_done) == (8, 8 * 64 * 64 * 4) == (last.tensors_total, last.bytes_total)

    view = inspect(result.target)
    assert view["format"] == "cs-h5" and view["tensors"] == 8
    dry = plan(str(src), to="torch", shard_size="40KB")
    assert dry["ok"] and len(dry["shards"]) == 4
    assert diff(str(src), result.target).identical

    with pytest.raises(CkptconvError) as err:  # cancelled before the first tensor: nothing published
        convert(str(src), str(tmp_path / "c.mdl"), to="cs-h5", cancelled=lambda: True)
    assert err.value.code == "cancelled" and not (tmp_path / "c.mdl").exists()
    with pytest.raises(CkptconvError) as err:
        convert(str(tmp_path / "missing.safetensors"), str(tmp_path / "x.mdl"), to="cs-h5")
    assert err.value.hint or err.value.code


def test_convert_model_in_process(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path / "hf")
    dry = plan_model(str(tmp_path / "hf"), model="llama", src_fmt="hf", tgt_fmt="cs-2.9")
    assert dry.tensors_total == 22 and not dry.unmatched
    stages: list[str] = []
    result = convert_model(
        str(tmp_path / "hf"),
        str(tmp_path / "out"),
        model="llama",
        src_fmt="hf",
        tgt_fmt="cs-2.9",
        progress=lambda p: stages.append(p.stage),
    )
    assert result.target == str(tmp_path / "out" / "model_to_cs-2.9.mdl")
    assert {"converting", "verifying", "done"} <= set(stages)
    assert any("Key not matched" in w for w in result.warnings)
