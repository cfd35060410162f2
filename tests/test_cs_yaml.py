"""The Cerebras run YAML is read in one place: model conversion and the simulator accept the same
model sections and refuse the same broken ones with the same typed error."""

from __future__ import annotations

from typing import Any

import pytest

from ckptconv.core.errors import ConfigConversionError
from ckptconv.engine.cs_yaml import dump_cs_yaml, model_section, parse_cs_yaml, replace_model_section
from ckptconv.engine.layouts.api import convert_config_dict
from ckptconv.engine.simulator.config import parse_model_config

GPT2 = {"name": "gpt2", "vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_hidden_layers": 2}


def test_both_layouts_give_the_same_section() -> None:
    legacy = {"model": GPT2}
    trainer = {"trainer": {"init": {"model": GPT2}}}
    assert model_section(legacy) == model_section(trainer) == GPT2
    assert parse_model_config(legacy).params == parse_model_config(trainer).params


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"trainer": [{"init": {"model": GPT2}}]}, "list of trainers"),
        ({"trainer": {"init": {"loop": {}}}}, "no init.model"),
        ({"train_input": {}}, "no `model:`"),
        ({"trainer": {"init": ["model"]}}, "trainer.init"),
    ],
)
def test_conversion_and_simulator_refuse_alike(doc: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigConversionError, match=match) as converting:
        convert_config_dict(doc, model="gpt2", src_fmt="cs-2.9", tgt_fmt="hf")
    with pytest.raises(ConfigConversionError, match=match) as simulating:
        parse_model_config(doc, "gpt2")
    assert str(converting.value) == str(simulating.value)


def test_parse_refuses_a_non_mapping_and_round_trips() -> None:
    with pytest.raises(ConfigConversionError, match="mapping"):
        parse_cs_yaml(b"- a\n- b\n")
    doc = replace_model_section({"trainer": {"init": {"model": {}}}}, GPT2)
    assert parse_cs_yaml(dump_cs_yaml(doc)) == doc
