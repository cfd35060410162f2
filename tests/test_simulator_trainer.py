"""``simulate`` writes checkpoints as the Model Zoo 2.10 trainer does (cs-checkpoint-format.md §6):
each policy option is shown by the files it produces and what they hold; a stopped-and-resumed run
reaches bit-identical weights to an uninterrupted one.
"""

from __future__ import annotations

import copy
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ckptconv.cli import main as cli_main
from ckptconv.core.errors import Cancelled, CheckpointError, CheckpointMismatch, InvalidRequest
from ckptconv.engine.simulator.checkpoint_io import open_checkpoint, read_checkpoint, top_level_keys, write_checkpoint
from ckptconv.engine.simulator.checkpoint_policy import CheckpointSettings, sort_checkpoints
from ckptconv.engine.simulator.trainer import simulate

MODEL = {
    "name": "gpt2",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_heads": 2,
    "filter_size": 64,
    "max_position_embeddings": 16,
    "nonlinearity": "gelu_new",
}


def config(
    *, checkpoint: dict[str, Any] | None = None, callbacks: list | None = None, max_steps: int = 4, model=None
) -> dict[str, Any]:
    return {
        "trainer": {
            "init": {
                "seed": 7,
                "model": dict(model or MODEL),
                "optimizer": {"AdamW": {"lr": 1e-3, "weight_decay": 0.01}},
                "schedulers": [
                    {"LinearLR": {"initial_learning_rate": 1e-3, "end_learning_rate": 1e-4, "total_iters": 10}}
                ],
                "loop": {"max_steps": max_steps},
                "checkpoint": dict(checkpoint or {"steps": 1}),
                "callbacks": list(callbacks or []),
            },
            "fit": {"train_dataloader": {"batch_size": 2, "max_sequence_length": 8}},
        }
    }


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def index(d: Path) -> list[str]:
    return [os.path.basename(p) for p in yaml.safe_load((d / "checkpoints_index.yaml").read_text())]


def load(path: str | Path, keys=None) -> dict[str, Any]:
    src = open_checkpoint(str(path))
    try:
        return read_checkpoint(src, keys)
    finally:
        src.close()


def clock(stamp: str):
    return lambda: datetime.strptime(stamp, "%Y%m%d_%H%M%S")


def test_checkpoint_contents(tmp_path: Path) -> None:
    cfg = config(max_steps=2)
    result = simulate(cfg, str(tmp_path))
    assert files(tmp_path) == ["checkpoint_1.mdl", "checkpoint_2.mdl", "checkpoints_index.yaml"]  # lock file removed
    assert index(tmp_path) == ["checkpoint_1.mdl", "checkpoint_2.mdl"]
    assert result["global_step"] == 2 and result["start_step"] == 0

    src = open_checkpoint(str(tmp_path / "checkpoint_2.mdl"))
    try:
        assert list(top_level_keys(src)) == [
            "model",
            "optimizer",
            "schedulers",
            "global_step",
            "dataloader",
            "__metadata__",
        ]
        kinds = {e.key: e.kind for e in src.entries()}
        # The tied LM head is stored once and linked, as cstorch.save stores tied weights.
        assert kinds["model.model.lm_head.weight"] == "link"
        assert kinds["model.model.transformer_decoder.norm.weight"] == "link"
        ckpt = read_checkpoint(src)
    finally:
        src.close()
    assert ckpt["global_step"] == 2
    assert ckpt["dataloader"] == {"samples_streamed": 4, "__version__": 1}
    assert ckpt["__metadata__"] == [{"version": "2.10.0", "model_name": "GPT2LMHeadModel", "params": cfg}]
    assert all(k.startswith("model.") for k in ckpt["model"])
    assert "model.embedding_layer.position_embeddings.embed.weight" in ckpt["model"]
    assert torch.equal(
        ckpt["model"]["model.lm_head.weight"], ckpt["model"]["model.embedding_layer.word_embeddings.weight"]
    )
    assert ckpt["schedulers"][0]["last_epoch"] == 2
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3 - 2 * (9e-4 / 10))
    assert {int(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {2}
    assert all(isinstance(k, int) for k in ckpt["optimizer"]["state"])


@pytest.mark.parametrize(
    ("steps", "max_steps", "expected"),
    [
        (3, 10, ["checkpoint_3.mdl", "checkpoint_6.mdl", "checkpoint_9.mdl", "checkpoint_10.mdl"]),
        (100, 4, ["checkpoint_4.mdl"]),  # N is capped at the run length
        (0, 3, []),  # no periodic saves, and none at the end either
        (None, 3, []),
    ],
)
def test_cadence(tmp_path: Path, steps, max_steps, expected) -> None:
    result = simulate(config(checkpoint={"steps": steps}, max_steps=max_steps), str(tmp_path))
    assert [os.path.basename(u) for u in result["checkpoints"]] == expected
    assert [f for f in files(tmp_path) if f.endswith(".mdl")] == sorted(expected)


def test_cadence_counts_from_the_resumed_step(tmp_path: Path) -> None:
    simulate(config(checkpoint={"steps": 4}, max_steps=4), str(tmp_path))
    result = simulate(config(checkpoint={"steps": 3}, max_steps=10), str(tmp_path))
    assert result["start_step"] == 4
    assert [os.path.basename(u) for u in result["checkpoints"]] == ["checkpoint_7.mdl", "checkpoint_10.mdl"]


def test_steps_are_reported_and_a_cancel_stops_between_steps(tmp_path: Path) -> None:
    seen: list[tuple[int, int, int]] = []
    with pytest.raises(Cancelled, match="global step 5"):
        simulate(
            config(checkpoint={"steps": 2}, max_steps=10),
            str(tmp_path),
            on_step=lambda *a: seen.append(a),
            cancelled=lambda: len(seen) >= 5,
        )
    assert seen == [(g, 0, 10) for g in range(1, 6)]
    # What was saved before the cancel stays, indexed, and a new run resumes from it.
    assert index(tmp_path) == ["checkpoint_2.mdl", "checkpoint_4.mdl"]
    assert simulate(config(checkpoint={"steps": 2}, max_steps=10), str(tmp_path))["start_step"] == 4


def test_custom_checkpoint_name(tmp_path: Path) -> None:
    simulate(config(checkpoint={"steps": 2, "checkpoint_name": "ckpt-{step}.h5"}, max_steps=4), str(tmp_path))
    assert files(tmp_path) == ["checkpoints_index.yaml", "ckpt-2.h5", "ckpt-4.h5"]
    result = simulate(config(checkpoint={"steps": 2, "checkpoint_name": "ckpt-{step}.h5"}, max_steps=6), str(tmp_path))
    assert os.path.basename(result["loaded_from"]) == "ckpt-4.h5"
    for bad in ("checkpoint.mdl", "ckpt_{step}_{rank}.mdl"):
        with pytest.raises(InvalidRequest, match="step"):
            simulate(config(checkpoint={"steps": 1, "checkpoint_name": bad}), str(tmp_path / "x"))


def test_name_collision_gets_a_timestamp_and_latest_prefers_it(tmp_path: Path) -> None:
    simulate(config(checkpoint={"steps": 2}, max_steps=4), str(tmp_path))
    # Resuming at step 4 with save_initial_checkpoint saves step 4 again: the name is taken.
    result = simulate(
        config(checkpoint={"steps": 2, "save_initial_checkpoint": True}, max_steps=6),
        str(tmp_path),
        now=clock("20240101_101010"),
    )
    assert [os.path.basename(u) for u in result["checkpoints"]] == [
        "checkpoint_4_20240101_101010.mdl",
        "checkpoint_6.mdl",
    ]
    assert index(tmp_path) == [
        "checkpoint_2.mdl",
        "checkpoint_4.mdl",
        "checkpoint_4_20240101_101010.mdl",
        "checkpoint_6.mdl",
    ]
    timestamped = load(tmp_path / "checkpoint_4_20240101_101010.mdl")
    plain = load(tmp_path / "checkpoint_4.mdl")
    assert timestamped["global_step"] == 4
    assert all(torch.equal(plain["model"][k], timestamped["model"][k]) for k in plain["model"])
    (tmp_path / "checkpoint_6.mdl").unlink()  # pruned from the index at the next start
    again = simulate(config(checkpoint={"steps": 2}, max_steps=4), str(tmp_path))
    assert os.path.basename(again["loaded_from"]) == "checkpoint_4_20240101_101010.mdl"
    assert "checkpoint_6.mdl" not in index(tmp_path)


def test_most_recent_by_step_then_timestamp() -> None:
    settings = CheckpointSettings()
    names = [
        "d/checkpoint_10_20240101_101010.mdl",
        "d/checkpoint_9.mdl",
        "d/model_checkpoint_10.mdl",  # SaveCheckpointState file: not a regular checkpoint
        "d/checkpoint_10.mdl",
        "d/checkpoint_10_20231231_235959.mdl",
        "d/checkpoint_1_2024.mdl",  # malformed timestamp: ignored
    ]
    assert sort_checkpoints(settings, names) == [
        "d/checkpoint_9.mdl",
        "d/checkpoint_10.mdl",
        "d/checkpoint_10_20231231_235959.mdl",
        "d/checkpoint_10_20240101_101010.mdl",
    ]


def test_missing_index_is_seeded_from_the_model_dir(tmp_path: Path) -> None:
    simulate(config(checkpoint={"steps": 1}, max_steps=3), str(tmp_path))
    (tmp_path / "checkpoints_index.yaml").unlink()
    (tmp_path / "notes_checkpoint_9.mdl").write_bytes(b"")  # basename does not match
    result = simulate(config(checkpoint={"steps": 1}, max_steps=4), str(tmp_path))
    assert os.path.basename(result["loaded_from"]) == "checkpoint_3.mdl"
    assert index(tmp_path) == ["checkpoint_1.mdl", "checkpoint_2.mdl", "checkpoint_3.mdl", "checkpoint_4.mdl"]


def test_autoload_can_be_disabled(tmp_path: Path) -> None:
    simulate(config(checkpoint={"steps": 2}, max_steps=2), str(tmp_path))
    result = simulate(
        config(checkpoint={"steps": 2, "autoload_last_checkpoint": False}, max_steps=2),
        str(tmp_path),
        now=clock("20240202_020202"),
    )
    assert result["loaded_from"] is None and result["start_step"] == 0
    assert files(tmp_path) == ["checkpoint_2.mdl", "checkpoint_2_20240202_020202.mdl", "checkpoints_index.yaml"]


def test_save_initial_checkpoint(tmp_path: Path) -> None:
    result = simulate(config(checkpoint={"steps": 2, "save_initial_checkpoint": True}, max_steps=2), str(tmp_path))
    assert [os.path.basename(u) for u in result["checkpoints"]] == ["checkpoint_0.mdl", "checkpoint_2.mdl"]
    initial = load(tmp_path / "checkpoint_0.mdl")
    assert initial["global_step"] == 0 and initial["optimizer"]["state"] == {}
    assert initial["dataloader"]["samples_streamed"] == 0


def test_keep_n_checkpoints_deletes_only_this_runs_oldest(tmp_path: Path) -> None:
    simulate(config(checkpoint={"steps": 1}, max_steps=3), str(tmp_path))
    result = simulate(
        config(checkpoint={"steps": 1}, callbacks=[{"KeepNCheckpoints": {"n": 2}}], max_steps=7), str(tmp_path)
    )
    assert [os.path.basename(u) for u in result["deleted"]] == ["checkpoint_4.mdl", "checkpoint_5.mdl"]
    assert [f for f in files(tmp_path) if f.endswith(".mdl")] == [
        "checkpoint_1.mdl",
        "checkpoint_2.mdl",
        "checkpoint_3.mdl",
        "checkpoint_6.mdl",
        "checkpoint_7.mdl",
    ]
    assert index(tmp_path) == [
        "checkpoint_1.mdl",
        "checkpoint_2.mdl",
        "checkpoint_3.mdl",
        "checkpoint_6.mdl",
        "checkpoint_7.mdl",
    ]


def test_save_checkpoint_state(tmp_path: Path) -> None:
    callbacks = [
        {"KeepNCheckpoints": {"n": 1}},
        {"SaveCheckpointState": {"k": 2, "checkpoint_states": "model,optimizer"}},
        {
            "SaveCheckpointState": {
                "k": 3,
                "checkpoint_states": "all",
                "checkpoint_name": "{checkpoint_states}-{ckpt_name}",
            }
        },
    ]
    result = simulate(config(checkpoint={"steps": 1}, callbacks=callbacks, max_steps=5), str(tmp_path))
    assert files(tmp_path) == [
        "all-checkpoint_3.mdl",
        "all-checkpoint_5.mdl",  # last step of the last loop
        "checkpoint_5.mdl",
        "checkpoints_index.yaml",
        "model_optimizer_checkpoint_2.mdl",
        "model_optimizer_checkpoint_4.mdl",
        "model_optimizer_checkpoint_5.mdl",  # last step
    ]
    assert index(tmp_path) == ["checkpoint_5.mdl"]  # state files stay out of the index and retention
    assert len(result["state_checkpoints"]) == 5
    subset = load(tmp_path / "model_optimizer_checkpoint_4.mdl")
    assert list(subset) == ["model", "optimizer", "__metadata__"]
    everything = load(tmp_path / "all-checkpoint_5.mdl")
    assert list(everything) == list(load(tmp_path / "checkpoint_5.mdl"))
    assert everything["global_step"] == 5
    with pytest.raises(InvalidRequest, match="sparsity"):
        simulate(
            config(
                checkpoint={"steps": 1},
                callbacks=[{"SaveCheckpointState": {"k": 1, "checkpoint_states": ["sparsity"]}}],
            ),
            str(tmp_path / "bad"),
        )


def test_load_checkpoint_states_model_only_restarts_fine_tuning(tmp_path: Path) -> None:
    pre = tmp_path / "pretrain"
    simulate(config(checkpoint={"steps": 4}, max_steps=4), str(pre))
    tune = tmp_path / "finetune"
    result = simulate(
        config(
            checkpoint={"steps": 3, "save_initial_checkpoint": True},
            callbacks=[{"LoadCheckpointStates": {"load_checkpoint_states": "model"}}],
            max_steps=3,
        ),
        str(tune),
        ckpt_path=str(pre / "checkpoint_4.mdl"),
    )
    assert result["start_step"] == 0 and result["global_step"] == 3
    assert files(tune) == ["checkpoint_0.mdl", "checkpoint_3.mdl", "checkpoints_index.yaml"]
    source, start, end = (
        load(pre / "checkpoint_4.mdl"),
        load(tune / "checkpoint_0.mdl"),
        load(tune / "checkpoint_3.mdl"),
    )
    assert all(torch.equal(source["model"][k], start["model"][k]) for k in source["model"])
    assert start["optimizer"]["state"] == {}  # fresh optimizer
    assert {int(s["step"]) for s in end["optimizer"]["state"].values()} == {3}
    assert end["dataloader"]["samples_streamed"] == 6  # the data stream restarted too
    assert end["schedulers"][0]["last_epoch"] == 3
    with pytest.raises(InvalidRequest, match="grad_scaler"):
        simulate(
            config(callbacks=[{"LoadCheckpointStates": {"load_checkpoint_states": ["model", "grad_scaler"]}}]),
            str(tmp_path / "x"),
            ckpt_path=str(pre / "checkpoint_4.mdl"),
        )


def _with_model_edit(src: Path, dst: Path, edit) -> str:
    ckpt = load(src)
    edit(ckpt)
    write_checkpoint(str(dst), ckpt, cstorch_version="2.10.0")
    return str(dst)


def test_disable_strict_checkpoint_loading(tmp_path: Path) -> None:
    base = tmp_path / "base"
    simulate(config(checkpoint={"steps": 1}, max_steps=1), str(base))

    def add_extra(ckpt: dict) -> None:
        ckpt["model"]["model.extra_head.weight"] = torch.zeros(2)

    extra = _with_model_edit(base / "checkpoint_1.mdl", tmp_path / "extra.mdl", add_extra)
    with pytest.raises(CheckpointMismatch, match=r"extra_head\.weight"):
        simulate(config(checkpoint={"steps": 1}, max_steps=2), str(tmp_path / "strict"), ckpt_path=extra)
    result = simulate(
        config(checkpoint={"steps": 1, "disable_strict_checkpoint_loading": True}, max_steps=2),
        str(tmp_path / "lenient"),
        ckpt_path=extra,
    )
    assert result["load"]["unexpected"] == ["extra_head.weight"]
    assert result["start_step"] == 1 and result["global_step"] == 2


def test_version_check(tmp_path: Path) -> None:
    base = tmp_path / "base"
    simulate(config(checkpoint={"steps": 1}, max_steps=1), str(base))

    def version(v: str):
        return lambda ckpt: ckpt["__metadata__"][-1].__setitem__("version", v)

    old = _with_model_edit(base / "checkpoint_1.mdl", tmp_path / "old.mdl", version("2.9.0"))
    with pytest.raises(CheckpointError, match=r"2\.9\.0"):
        simulate(config(max_steps=2), str(tmp_path / "a"), ckpt_path=old)
    result = simulate(
        config(checkpoint={"steps": 1, "strict_version": False}, max_steps=2), str(tmp_path / "b"), ckpt_path=old
    )
    assert len(result["warnings"]) == 1 and "2.9.0" in result["warnings"][0]
    local = _with_model_edit(base / "checkpoint_1.mdl", tmp_path / "local.mdl", version("2.9.0+abc"))
    assert simulate(config(max_steps=2), str(tmp_path / "c"), ckpt_path=local)["warnings"] == []


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    model = {**MODEL, "dropout_rate": 0.1, "num_hidden_layers": 2}  # dropout on: RNG must not matter
    cfg = config(checkpoint={"steps": 2}, max_steps=9, model=model)
    straight = simulate(cfg, str(tmp_path / "straight"))
    first = simulate(cfg, str(tmp_path / "resumed"), stop_after=5)
    assert first["interrupted"] and first["global_step"] == 5
    assert [os.path.basename(u) for u in first["checkpoints"]] == ["checkpoint_2.mdl", "checkpoint_4.mdl"]
    second = simulate(cfg, str(tmp_path / "resumed"))
    assert os.path.basename(second["loaded_from"]) == "checkpoint_4.mdl" and second["start_step"] == 4
    a = load(tmp_path / "straight" / "checkpoint_9.mdl")
    b = load(tmp_path / "resumed" / "checkpoint_9.mdl")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for i, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][i][name])
    assert a["schedulers"] == b["schedulers"] and a["dataloader"] == b["dataloader"]
    assert straight["losses"][4:] == second["losses"]


def test_s3_checkpoint_root(tmp_path: Path, s3_bucket: str) -> None:
    from ckptconv.storage import open_storage

    root = f"s3://{s3_bucket}/run1"
    cfg = config(
        checkpoint={"steps": 1, "checkpoint_root": root}, callbacks=[{"KeepNCheckpoints": {"n": 2}}], max_steps=3
    )
    result = simulate(cfg, str(tmp_path))
    storage = open_storage(root)
    names = sorted(info.uri for info in storage.list(root + "/"))
    assert names == [f"{root}/checkpoint_2.mdl", f"{root}/checkpoint_3.mdl"]
    assert yaml.safe_load((tmp_path / "checkpoints_index.yaml").read_text()) == names
    assert result["deleted"] == [f"{root}/checkpoint_1.mdl"]
    again = simulate(config(checkpoint={"steps": 1, "checkpoint_root": root}, max_steps=4), str(tmp_path))
    assert again["loaded_from"] == f"{root}/checkpoint_3.mdl"
    assert load(f"{root}/checkpoint_4.mdl", ["global_step"]) == {"global_step": 4}


def test_legacy_runconfig_layout(tmp_path: Path) -> None:
    cfg = {
        "model": dict(MODEL),
        "optimizer": {
            "optimizer_type": "SGD",
            "momentum": 0.9,
            "learning_rate": {"scheduler": "Constant", "learning_rate": 0.01},
        },
        "train_input": {"batch_size": 3, "max_sequence_length": 8},
        "runconfig": {
            "max_steps": 4,
            "checkpoint_steps": 1,
            "max_checkpoints": 2,
            "save_initial_checkpoint": True,
            "seed": 3,
        },
    }
    result = simulate(copy.deepcopy(cfg), str(tmp_path))
    assert [os.path.basename(u) for u in result["checkpoints"]] == [f"checkpoint_{i}.mdl" for i in range(5)]
    assert [f for f in files(tmp_path) if f.endswith(".mdl")] == ["checkpoint_3.mdl", "checkpoint_4.mdl"]
    ckpt = load(tmp_path / "checkpoint_4.mdl")
    assert ckpt["dataloader"]["samples_streamed"] == 12
    assert (
        ckpt["optimizer"]["param_groups"][0]["momentum"] == 0.9 and ckpt["optimizer"]["param_groups"][0]["lr"] == 0.01
    )


def test_every_model_class_trains_and_checkpoints(tmp_path: Path) -> None:
    models = {
        "llama": {
            **{k: v for k, v in MODEL.items() if k != "nonlinearity"},
            "name": "llama",
            "position_embedding_type": "rotary",
            "rotary_dim": 16,
            "norm_type": "rmsnorm",
            "nonlinearity": "swiglu",
            "attention_module": "multiquery_attention",
            "extra_attention_params": {"num_kv_groups": 1},
            "moe": {"num_experts": 2, "top_k": 1},
        },
        "gpt-neox": {**MODEL, "name": "gpt-neox", "rotary_dim": 4, "use_untied_layer_norm": True},
        "bert": {**MODEL, "name": "bert", "encoder_nonlinearity": "gelu"},
        "bert-qa": {**MODEL, "name": "bert-qa"},
        "t5": {
            "name": "t5",
            "src_vocab_size": 64,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 48,
            "num_heads": 2,
            "encoder_num_hidden_layers": 1,
            "relative_attention_num_buckets": 8,
        },
    }
    for name, model in models.items():
        d = tmp_path / name
        result = simulate(config(checkpoint={"steps": 2}, max_steps=2, model=model), str(d))
        assert files(d) == ["checkpoint_2.mdl", "checkpoints_index.yaml"], name
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        again = simulate(config(checkpoint={"steps": 2}, max_steps=3, model=model), str(d))
        assert again["start_step"] == 2 and again["load"]["missing"] == []


def test_cli_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg_path = tmp_path / "params.yaml"
    cfg_path.write_text(yaml.safe_dump(config(checkpoint={"steps": 5}, max_steps=2)))
    d = tmp_path / "model_dir"
    rc = cli_main(
        ["simulate", "--config", str(cfg_path), "--model-dir", str(d), "--steps", "3", "--checkpoint-steps", "1"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "finished:    global step 3 of 3" in out and "checkpoint_3.mdl" in out
    assert files(d) == ["checkpoint_1.mdl", "checkpoint_2.mdl", "checkpoint_3.mdl", "checkpoints_index.yaml"]
    rc = cli_main(["simulate", "--config", str(cfg_path), "--model-dir", str(d), "--steps", "4", "--json"])
    assert rc == 0
    assert '"start_step": 3' in capsys.readouterr().out
