"""Composite and wrapper models are tables read by the same loader as the families, each with its
planner beside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptconv.engine.layouts.models import planner_of, planners
from ckptconv.engine.layouts.registry import is_known_model, model_tables
from ckptconv.engine.layouts.rules import TableError
from ckptconv.engine.layouts.tables import FAMILIES_DIR, load_tables


def test_every_composite_and_wrapper_table_has_its_planner() -> None:
    tables = model_tables()
    assert {n: t.kind for n, t in tables.items()} == {"dpo": "wrapper", "dpr": "composite", "llava": "composite"}
    assert set(planners()) == set(tables)
    for name, table in tables.items():
        found = planner_of(name)
        assert found is not None and found[0] is table and name == found[1].MODEL_NAME
        assert is_known_model(name)
    assert planner_of("llama") is None
    assert tables["dpr"].routes() == [
        ("q_encoder", "question_encoder.bert_model."),
        ("ctx_encoder", "ctx_encoder.bert_model."),
    ]
    assert tables["dpo"].formats[-1] == "cs-2.1-no-dpo" and tables["dpo"].formats[1] == "cs-2.1-dpo"


def test_importing_the_layouts_reads_no_table() -> None:
    # The planners beside the composite and wrapper tables read them when imported; they are imported
    # when such a model is first planned, so a process importing the layouts pays nothing for them.
    code = (
        "import ckptconv.engine.layouts.api\n"
        "from ckptconv.engine.layouts import registry\n"
        "print(registry._tables.cache_info().currsize)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def _copy_tables(tmp_path: Path) -> Path:
    for path in Path(FAMILIES_DIR).glob("*.yaml"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_a_new_composite_table_is_loaded_from_data(tmp_path: Path) -> None:
    (_copy_tables(tmp_path) / "twin_bert.yaml").write_text(
        "family: twin-bert\nkind: composite\ndescription: two BERTs\ncs_class: TwinModel\nnames: [twin-bert]\n"
        'releases: {cs: ["2.8", "2.9"]}\n'
        "parts:\n"
        "  - {name: left, family: bert, hf_route: left., cs_prefix: model.left., hf_class: BertModel}\n"
        "  - {name: right, family: bert, hf_route: right., cs_prefix: model.right., hf_class: BertModel}\n"
    )
    families, models = load_tables(str(tmp_path))
    twin = models["twin-bert"]
    assert "twin-bert" not in families and "bert" in families
    assert twin.components == ["left", "right"] and twin.formats == ("cs-2.8", "cs-2.9")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("parts:\n  - {name: a, family: no-such, hf_route: a., cs_prefix: model.a., hf_class: X}\n", "no-such"),
        ("parts:\n  - {name: a, family: bert}\n", "exactly the fields"),
        ("", "lists its `parts`"),
        ("keys: []\nparts: []\n", "unknown top-level fields"),
    ],
)
def test_a_broken_composite_table_is_refused(tmp_path: Path, extra: str, match: str) -> None:
    (_copy_tables(tmp_path) / "broken.yaml").write_text(
        "family: broken\nkind: composite\ndescription: x\ncs_class: X\nnames: [broken]\n"
        'releases: {cs: ["2.9", "2.9"]}\n' + extra
    )
    with pytest.raises(TableError, match=match):
        load_tables(str(tmp_path))


def test_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    (_copy_tables(tmp_path) / "odd.yaml").write_text("family: odd\nkind: bundle\n")
    with pytest.raises(TableError, match="kind is one of"):
        load_tables(str(tmp_path))
