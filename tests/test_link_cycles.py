"""Tied-weight links are followed by one function (ckptconv.formats.links.link_root) with one
policy on a cycle: LinkCycle, whichever front door meets it (inspect, convert, diff)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptconv.cli.main import main as cli
from ckptconv.core.errors import CorruptCheckpoint, LinkCycle
from ckptconv.engine.diff import diff_checkpoints
from ckptconv.formats.base import Entry
from ckptconv.formats.detect import open_source
from ckptconv.formats.links import link_root, link_target, refuse_link_cycles

ATTACKS = Path(__file__).resolve().parent / "attacks"
CYCLES = {"h5_link_cycle.mdl": "cs-h5", "st_link_cycle.safetensors": "safetensors"}


def _by_key(*entries: Entry) -> dict[str, Entry]:
    return {e.key: e for e in entries}


def test_link_root_follows_chains_and_refuses_cycles() -> None:
    w = Entry("w", "tensor", "float32", (2,))
    chain = _by_key(w, Entry("a", "link", target="b"), Entry("b", "link", target="w"))
    assert link_root("a", chain) == "w" and link_root("w", chain) == "w"
    assert link_target("a", chain) is w
    dangling = _by_key(Entry("a", "link", target="gone"))
    assert link_root("a", dangling) == "gone" and link_target("a", dangling) is None
    cycle = _by_key(w, Entry("a", "link", target="b"), Entry("b", "link", target="c"), Entry("c", "link", target="b"))
    with pytest.raises(LinkCycle, match="a -> b -> c -> b") as caught:
        link_root("a", cycle)
    assert isinstance(caught.value, CorruptCheckpoint) and caught.value.code == "link_cycle"
    with pytest.raises(LinkCycle):
        refuse_link_cycles(cycle.values())
    refuse_link_cycles(chain.values())


@pytest.mark.parametrize("name", sorted(CYCLES))
def test_every_front_door_answers_link_cycle(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(ATTACKS / name)
    fmt = CYCLES[name]
    with pytest.raises(LinkCycle):
        open_source(src, fmt).entries()
    other = "safetensors" if fmt == "cs-h5" else "cs-h5"
    for argv in (
        ["inspect", src, "--from", fmt],
        ["convert", src, str(tmp_path / "out"), "--to", other, "--from", fmt, "--no-progress"],
        ["diff", src, src, "--from-a", fmt, "--from-b", fmt, "--no-progress"],
    ):
        assert cli(argv) == 2, argv
        assert "[link_cycle]" in capsys.readouterr().err, argv


def test_diff_follows_ties(tmp_path: Path) -> None:
    import torch

    w = torch.arange(4.0)
    torch.save({"w": w, "tied": w}, tmp_path / "tied.pt")  # "tied" is read back as a link to "w"
    torch.save({"w": w.clone(), "tied": w.clone()}, tmp_path / "copies.pt")
    torch.save({"w": w.clone(), "tied": w + 1}, tmp_path / "other.pt")
    assert any(e.kind == "link" for e in open_source(str(tmp_path / "tied.pt")).entries())
    assert diff_checkpoints(str(tmp_path / "tied.pt"), str(tmp_path / "copies.pt")).identical
    differs = diff_checkpoints(str(tmp_path / "tied.pt"), str(tmp_path / "other.pt"))
    assert [d.key for d in differs.differences] == ["tied"]
