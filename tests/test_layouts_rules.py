"""The key-pattern engine, the table expressions and table validation (pure: no tensors, no files)."""

from __future__ import annotations

import pytest

from ckptconv.core.errors import ConfigConversionError
from ckptconv.engine.layouts.expr import ExprError, evaluate, names_in
from ckptconv.engine.layouts.registry import _build_family, families, model_index, resolve
from ckptconv.engine.layouts.rules import Pattern, TableError, map_keys, parse_rules, strip_hf_prefix

# --- patterns ---------------------------------------------------------------------------------


def test_pattern_match_and_format() -> None:
    p = Pattern.compile("model.layers.{layer}.mlp.{wb}")
    assert p.match("model.layers.12.mlp.weight") == {"layer": "12", "wb": "weight"}
    assert p.match("model.layers.x.mlp.weight") is None
    assert p.match("model.layers.1.mlp.weight.extra") is None  # full match only
    assert p.match("model_layers.1.mlp.weight") is None  # dots are literal
    assert p.format({"layer": 3, "wb": "bias"}) == "model.layers.3.mlp.bias"


def test_pattern_inline_regex_and_repeats() -> None:
    p = Pattern.compile("{stack:encoder|decoder}.block.{layer}.x")
    assert p.match("decoder.block.0.x") == {"stack": "decoder", "layer": "0"}
    assert p.match("middle.block.0.x") is None
    q = Pattern.compile("{a:\\d+}.{a}")
    assert q.match("3.3") == {"a": "3"} and q.match("3.4") is None


@pytest.mark.parametrize("bad", ["", "a.{undeclared}", "a.{layer", "a}.b"])
def test_bad_patterns(bad: str) -> None:
    with pytest.raises(TableError):
        Pattern.compile(bad)


# --- mapping ----------------------------------------------------------------------------------

TABLE = {
    "keys": [
        "emb.weight -> embedding.weight",
        {
            "hf": "h.{layer}.qkv.{wb}",
            "cs": ["l.{layer}.q.{wb}", "l.{layer}.k.{wb}", "l.{layer}.v.{wb}"],
            "transform": "fused",
            "params": {"groups": 1, "unit": 1, "parts": {"q": 1, "k": 1, "v": 1}, "outputs": ["q", "k", "v"]},
        },
        {
            "hf": "h.{layer}.e.{expert}.w",
            "cs": "l.{layer}.experts",
            "transform": "stack_experts",
            "stack": {"expert": "n_experts"},
        },
        {"hf": "norm.weight", "cs": "final.weight", "also_cs": "ln_f.weight"},
        {"hf": "gated.weight", "cs": "g.weight", "when": "gated"},
        "head.weight -> head.weight",
    ],
    "drop": {"hf": ["h.{layer}.buffer"], "cs": ["cs_only.x"]},
    "fill": {"hf": [{"key": "head.weight", "from": "emb.weight", "when": "tie"}]},
    "derive": {
        "hf": [{"key": "h.{layer}.mask", "from": "l.{layer}.q.bias", "transform": "causal_mask", "params": {"size": 4}}]
    },
}
ENV = {"n_experts": 2, "gated": True, "tie": True}


def rules():
    return parse_rules(TABLE, "test")


def test_import_split_stack_also_and_fill() -> None:
    keys = [
        "emb.weight",
        "h.0.qkv.weight",
        "h.0.qkv.bias",
        "h.0.e.0.w",
        "h.0.e.1.w",
        "norm.weight",
        "gated.weight",
        "h.0.buffer",
        "stray",
    ]
    m = map_keys(rules(), "import", keys, ENV)
    out = {o.key: o for o in m.outputs}
    assert set(out) == {
        "embedding.weight",
        "l.0.q.weight",
        "l.0.k.weight",
        "l.0.v.weight",
        "l.0.q.bias",
        "l.0.k.bias",
        "l.0.v.bias",
        "l.0.experts",
        "final.weight",
        "ln_f.weight",
        "g.weight",
        "head.weight",
    }
    assert [out[f"l.0.{n}.weight"].index for n in "qkv"] == [0, 1, 2]
    assert out["l.0.experts"].inputs == ["h.0.e.0.w", "h.0.e.1.w"]
    assert out["head.weight"].inputs == ["emb.weight"]  # filled from its tied partner
    assert any("head.weight" in w and "emb.weight" in w for w in m.warnings)
    assert m.unmatched == ["stray"]
    assert m.dropped == ["h.0.buffer"]


def test_export_merge_unstack_drop_also_and_derive() -> None:
    keys = [
        "embedding.weight",
        "l.0.q.bias",
        "l.0.k.bias",
        "l.0.v.bias",
        "l.0.experts",
        "final.weight",
        "ln_f.weight",
        "cs_only.x",
        "head.weight",
        "g.weight",
    ]
    m = map_keys(rules(), "export", keys, ENV)
    out = {o.key: o for o in m.outputs}
    assert out["h.0.qkv.bias"].inputs == ["l.0.q.bias", "l.0.k.bias", "l.0.v.bias"]
    assert {k for k in out if ".e." in k} == {"h.0.e.0.w", "h.0.e.1.w"}
    assert out["h.0.e.1.w"].index == 1
    assert out["h.0.mask"].transform == "causal_mask"
    assert sorted(m.dropped) == ["cs_only.x", "ln_f.weight"]
    assert not m.unmatched and not m.warnings


def test_incomplete_group_is_unmatched() -> None:
    m = map_keys(rules(), "export", ["l.0.q.bias", "l.0.k.bias"], ENV)
    assert sorted(m.unmatched) == ["l.0.k.bias", "l.0.q.bias"]
    assert "l.0.v.bias" in m.incomplete[0]


def test_when_selects_rules() -> None:
    m = map_keys(rules(), "import", ["gated.weight"], {**ENV, "gated": False})
    assert m.unmatched == ["gated.weight"]


def test_first_rule_wins() -> None:
    r = parse_rules({"keys": ["a.{layer} -> first.{layer}", "a.{layer} -> second.{layer}"]}, "t")
    m = map_keys(r, "import", ["a.1"], {})
    assert [o.key for o in m.outputs] == ["first.1"]


def test_fill_warns_only_when_used_and_absent_values_fill() -> None:
    r = parse_rules({"keys": ["x.weight -> y.weight"], "fill": {"cs": [{"key": "y.weight", "from": "z.weight"}]}}, "t")
    m = map_keys(r, "export", ["y.weight", "z.weight"], {}, absent=["y.weight"])
    assert m.outputs[0].inputs == ["z.weight"] and m.warnings
    r = parse_rules({"keys": ["x.weight -> y.weight"], "fill": {"cs": [{"key": "q.weight", "from": "y.weight"}]}}, "t")
    m = map_keys(r, "export", ["y.weight"], {})  # q.weight would be filled, but no rule reads it: no warning
    assert [o.key for o in m.outputs] == ["x.weight"] and not m.warnings


def test_headless_strips_prefix_and_synthesizes_head() -> None:
    fam, var = resolve("llama-headless")
    r = fam.rules_for(var)
    assert all(not p.text.startswith("model.") for k in r.keys for p in k.hf)
    m = map_keys(r, "import", ["embed_tokens.weight", "norm.weight"], {"tie": False})
    head = next(o for o in m.outputs if o.key == "lm_head.weight")
    assert head.transform == "lm_head" and head.inputs == ["embed_tokens.weight"]
    m = map_keys(r, "export", ["embedding_layer.word_embeddings.weight", "lm_head.weight"], {"tie": False})
    assert m.dropped == ["lm_head.weight"]


def test_strip_prefix_drops_rules_outside_it() -> None:
    r = strip_hf_prefix(rules(), "h.")
    assert all(k.hf[0].text.startswith("{layer}") for k in r.keys)


# --- table validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table",
    [
        {"keys": [{"hf": "a.{expert}", "cs": "b"}]},  # one-sided placeholder without stack
        {"keys": [{"hf": "a", "cs": "b", "bogus": 1}]},
        {"keys": [{"hf": "a", "cs": "b", "direction": "sideways"}]},
        {"keys": ["a => b"]},
        {"keys": [], "extra": []},
        {"fill": {"hf": [{"key": "a.{layer}", "from": "b"}]}},
    ],
)
def test_bad_tables(table: dict) -> None:
    with pytest.raises(TableError):
        parse_rules(table, "test")


def test_family_validation_rejects_unknown_transform_and_hook() -> None:
    base = {
        "family": "x",
        "cs_class": "X",
        "names": ["x"],
        "releases": {"hf": ["2.1", "2.9"], "cs": ["2.1", "2.9"]},
        "checkpoint": {"keys": [{"hf": "a", "cs": "b", "transform": "nope"}]},
        "config": {},
    }
    with pytest.raises(TableError, match="unknown transform"):
        _build_family(base, "x.yaml")
    base["checkpoint"] = {"keys": ["a -> b"]}
    base["config"] = {"hooks": ["nope"]}
    with pytest.raises(TableError, match="unknown config hooks"):
        _build_family(base, "x.yaml")
    base["config"] = {}
    base["releases"] = {"hf": ["2.0", "2.9"], "cs": ["2.1", "2.9"]}
    with pytest.raises(TableError, match="within"):
        _build_family(base, "x.yaml")


def test_every_shipped_table_loads_and_names_are_unique() -> None:
    fams = families()
    assert {
        "llama",
        "mistral",
        "mixtral",
        "gpt2",
        "gptj",
        "codegen",
        "gpt-neox",
        "falcon",
        "bloom",
        "starcoder",
        "santacoder",
        "btlm",
        "jais",
        "gemma2",
        "bert",
        "roberta",
        "t5",
        "mpt",
    } <= set(fams)
    names = model_index()
    for required in [
        "bert",
        "bert-sequence-classifier",
        "bert-token-classifier",
        "bert-summarization",
        "bert-q&a",
        "bert-qa",
        "bloom-headless",
        "btlm-headless",
        "codegen-headless",
        "code-llama-headless",
        "falcon-headless",
        "flan-ul2",
        "gpt2-headless",
        "gptj-headless",
        "gpt-neox-headless",
        "jais",
        "llamaV2-headless",
        "mpt-headless",
        "mistral-headless",
        "octocoder-headless",
        "roberta",
        "santacoder-headless",
        "sqlcoder-headless",
        "starcoder-headless",
        "t5",
        "transformer",
        "ul2",
        "wizardcoder-headless",
        "wizardlm-headless",
        "mixtral-headless",
        "gemma2",
        "llava",
        "dpr",
    ]:
        assert required in names, required


@pytest.mark.parametrize(
    ("alias", "family"),
    [
        ("bert-qa", "bert"),
        ("ul2", "t5"),
        ("llamaV2", "llama"),
        ("sqlcoder", "starcoder"),
        ("btlm-headless", "btlm"),
        ("starcoder-headless", "starcoder"),
        ("LLAMA", "llama"),
    ],
)
def test_model_zoo_broken_names_resolve(alias: str, family: str) -> None:
    fam, _ = resolve(alias)
    assert fam.name == family


# --- expressions --------------------------------------------------------------------------------


def test_expressions() -> None:
    env = {"hidden_size": 64, "num_heads": 4, "attention_module": "multiquery_attention", "kv": 2, "x": None}
    assert evaluate("hidden_size // num_heads", env) == 16
    assert evaluate("kv if attention_module == 'multiquery_attention' else num_heads", env) == 2
    assert evaluate("(x or hidden_size) // 4", env) == 16
    assert evaluate({"a": "num_heads * 2", "b": [1, "kv"]}, env) == {"a": 8, "b": [1, 2]}
    assert evaluate("sqrt(hidden_size)", env) == 8.0
    assert evaluate("get('absent', 3) + get('kv', 0)", env) == 5  # optional keys say so explicitly
    assert names_in("a + b // min(c, 2)") == {"a", "b", "c"}
    with pytest.raises(ConfigConversionError, match="missing_key"):
        evaluate("missing_key + 1", env)


@pytest.mark.parametrize(
    "bad", ["__import__('os')", "x.__class__", "open('f')", "[i for i in x]", "lambda: 1", "x[0]", "min(x, key=1)"]
)
def test_expressions_refuse_code(bad: str) -> None:
    with pytest.raises(ExprError):
        evaluate(bad, {"x": [1]})
