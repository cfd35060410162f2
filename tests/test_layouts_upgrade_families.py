"""Release upgrades for every model family, end to end through files, with tiny random models.

For each family table (``ckptconv/engine/layouts/families/*.yaml``) a tiny random model is built exactly as
``test_layouts_families`` builds it (transformers classes from a config, no downloads; remote-code
families from a synthetic state dict) and converted along two routes to the newest release:

    hf --------------------------------------------> cs-2.9    (direct import)
    hf --> cs-<oldest> --(one pass, every release)--> cs-2.9    (upgrade)

``<oldest>`` is the oldest release of the family's ``releases.cs`` range, reached from Hugging Face
through the release graph. The checks, one test function each, parametrized over the families:

1. ``upgrade``: the upgraded ``model`` section holds the same keys and bit-identical tensors as
   the direct import. No allowance is needed: the import already fills tied partners that the
   safetensors input omits (``lm_head``, the final norm's ``ln_f`` copy), so the tied-pair repair
   of the 1.9 -> 2.0 edge (reference §5) has nothing to repair and changes no value.
2. ``downgrade``: cs-2.9 -> cs-<oldest> in one pass (a downgrade across several releases) gives
   back the step-1 cs-<oldest> checkpoint exactly; ``hf_back``: cs-<oldest> -> hf gives back the
   original HF tensors exactly, and the same HF checkpoint as a direct cs-2.9 -> hf export.
3. ``config``: the model section of the upgraded cs-2.9 config equals the direct import's value
   for value; CS -> CS outputs carry a ``__metadata__`` record ``{version: "<tgt>.0", model_name:
   "", params: <converted config>}`` and HF -> CS outputs none (reference §1.1); the downgraded
   config equals the step-1 config.

Cases that cannot pass are marked xfail (strict, with the exact exception) and say why.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ckptconv.core.errors import ConfigConversionError, NoConversionPath
from ckptconv.core.releases import RELEASES, release_key
from ckptconv.engine.layouts.api import convert_model
from ckptconv.engine.layouts.registry import families, resolve

transformers = pytest.importorskip("transformers")

from test_layouts_dpo import load_cs  # noqa: E402
from test_layouts_families import CASES, HEADS, REMOTE, _randomize, _synthetic, load_dir  # noqa: E402

NEWEST = f"cs-{RELEASES[-1]}"


# --- cases ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    model: str  # --model
    build: Callable[[str], dict[str, torch.Tensor]]  # writes an HF directory, returns its tensors
    oldest: str  # cs-X.Y: the release the upgrade starts from
    via: tuple[str, ...] = ()  # releases step 1 passes through on its way from hf to ``oldest``
    # HF keys that come back within float32 rounding instead of bit-exactly (documented arithmetic)
    inexact: Callable[[str], bool] | None = None


def _from_transformers(build: Callable[[], Any]) -> Callable[[str], dict[str, torch.Tensor]]:
    def write(path: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        _randomize(build()).save_pretrained(path)
        return load_dir(path)

    return write


def _from_state_dict(keys: dict[str, tuple[int, ...]], cfg: dict[str, Any]) -> Callable[[str], dict]:
    return lambda path: _synthetic(keys, cfg, path)


def _oldest(model: str) -> str:
    return f"cs-{resolve(model)[0].cs_releases[0]}"


def _family_case(model: str, nth: int = 0, *, oldest: str | None = None, suffix: str = "", **kw: Any) -> Case:
    build = [c for c in CASES if c.model == model][nth].build
    rel = oldest or _oldest(model)
    return Case(f"{model}{suffix}@{rel}", model, _from_transformers(build), rel, **kw)


def _gemma_norm(key: str) -> bool:
    # Gemma 2 RMSNorm weights are stored +1 on the CS side (reference §3.15: +1 on import, -1 on
    # export): (w + 1) - 1 is not w in float32, on every route alike.
    return key.endswith("norm.weight")


CHAIN_CASES: list[Case] = [
    _family_case("llama"),
    _family_case("mistral"),
    _family_case("mixtral"),
    _family_case("gemma2", inexact=_gemma_norm),
    _family_case("gpt2"),
    _family_case("gptj"),
    _family_case("codegen"),
    _family_case("gpt-neox"),
    _family_case("falcon"),
    _family_case("bloom"),
    _family_case("starcoder"),
    _family_case("mpt"),
    _family_case("roberta"),
    # BERT's table reaches back to 1.6, but an HF BERT cannot be expressed before 1.8 (xfail below);
    # 1.8 is the oldest release it reaches.
    _family_case("bert"),
    _family_case("bert", oldest="cs-1.8"),
    # T5: 1.6 keyed the model with HF-style names (``hf_style_releases``); 1.7 is the oldest
    # release in the CS vocabulary. The 1.6 layout is also reached through 1.7 (cs-1.7 -> cs-1.6
    # is the tool's HF-style writer), which isolates the upgrade graph from the hf <-> 1.6 step.
    _family_case("t5"),
    _family_case("t5", suffix="-via-cs-1.7", via=("cs-1.7",)),
    _family_case("t5", oldest="cs-1.7"),
    _family_case("t5", 1, oldest="cs-1.7", suffix="-gated"),
    *[
        Case(f"{name}@{_oldest(name)}", name, _from_state_dict(keys, cfg), _oldest(name))
        for name, keys, cfg in REMOTE  # santacoder, btlm, jais (remote code: synthetic state dicts)
    ],
    # Fine-tuning heads: like BERT, 1.8 is the oldest release an HF model reaches.
    *[Case(f"{name}@cs-1.8", name, _from_transformers(build), "cs-1.8") for name, build, _ in HEADS],
]

# Family tables without an upgrade case here, and why.
NOT_COVERED = {"clip-vit": "hf <-> cs-2.1 ... cs-2.9 only (no older release); tests/test_layouts_llava.py covers it"}


class WrongLayout(AssertionError):
    """hf -> cs-<release> did not write that release's layout."""


BERT_PRE_1_8 = (
    "not convertible by design: an HF BERT always has a tanh pooler and an MLM transform with the "
    "encoder's activation, while releases before 1.8 fix pooler = encoder activation and MLM = gelu "
    "(reference §5, 1.7 -> 1.8: 'reverse requires them'), so hf -> cs-1.6 raises ConfigConversionError"
)
HF_STYLE_REFUSED = (
    "refused on purpose (NoConversionPath, naming the route through cs-1.7): the 1.6 layout keys the "
    "model with HF-style names and is reached from the CS vocabulary (cs-1.7 -> cs-1.6), which the "
    "-via-cs-1.7 case covers; hf <-> cs-1.6 in one pass is not planned"
)
CHECKS = ("upgrade", "downgrade", "hf_back", "config")  # one test function each, below
XFAILS: dict[tuple[str, str], tuple[Any, str]] = {
    # hf <-> cs-1.6 is refused (HF-style layout); cs-2.9 -> cs-1.6 fails on the pooler/MLM settings.
    **{
        ("bert@cs-1.6", check): ((NoConversionPath, ConfigConversionError), f"{HF_STYLE_REFUSED}; {BERT_PRE_1_8}")
        for check in CHECKS
    },
    **{("t5@cs-1.6", check): (NoConversionPath, HF_STYLE_REFUSED) for check in CHECKS},
    ("t5-via-cs-1.7@cs-1.6", "hf_back"): (NoConversionPath, HF_STYLE_REFUSED),
}


def cases(check: str) -> list[Any]:
    out = []
    for c in CHAIN_CASES:
        marks = []
        if (c.id, check) in XFAILS:
            exc, reason = XFAILS[(c.id, check)]
            marks.append(pytest.mark.xfail(raises=exc, strict=True, reason=reason))
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


# --- running the chain once per family ------------------------------------------------------------


@dataclass
class Out:
    """One CS output: the ``model`` tensors, the other (non-tensor) entries, the config file."""

    mdl: str
    yml: str
    path: list[str]
    model: dict[str, torch.Tensor]
    values: dict[str, Any]
    config: dict[str, Any]


def _stage(fn: Callable[[Chain], Any]) -> Any:
    """A chain stage, computed once; a failure is kept and raised again for every test that needs it
    (outputs are never overwritten, so a stage cannot simply be run twice)."""

    @functools.wraps(fn)
    def get(self: Chain) -> Any:
        name = fn.__name__
        if name not in self.done:
            try:
                self.done[name] = (True, fn(self))
            except Exception as e:  # kept, and raised again to each caller below
                self.done[name] = (False, e)
        ok, value = self.done[name]
        if not ok:
            raise value
        return value

    return property(get)


def _read_cs(r: Any) -> Out:
    from ckptconv.formats.detect import open_source

    mdl = next(o.uri for o in r.outputs if o.uri.endswith(".mdl"))
    yml = next(o.uri for o in r.outputs if o.uri.endswith(".yaml"))
    src = open_source(mdl)
    try:
        values = {e.key: e.value for e in src.entries() if e.kind == "value"}
    finally:
        src.close()
    model = {k: v for k, v in load_cs(mdl).items() if k.startswith("model.")}
    path = list(r.extras["model_conversion"]["path"])
    return Out(mdl, yml, path, model, values, yaml.safe_load(Path(yml).read_text()))


class Chain:
    def __init__(self, case: Case, root: Path) -> None:
        self.case, self.root = case, root
        self.done: dict[str, tuple[bool, Any]] = {}

    def _convert(self, src: str, out: str, src_fmt: str, tgt_fmt: str, config: str | None = None) -> Any:
        return convert_model(
            src, str(self.root / out), model=self.case.model, src_fmt=src_fmt, tgt_fmt=tgt_fmt, config=config
        )

    @_stage
    def original(self) -> dict[str, torch.Tensor]:
        return self.case.build(str(self.root / "hf"))

    @_stage
    def old(self) -> Out:
        """Step 1: hf -> cs-<oldest> (through ``via`` when the case says so)."""
        self.original  # noqa: B018 - writes the HF directory
        src, src_fmt, cfg = str(self.root / "hf"), "hf", None
        for i, rel in enumerate((*self.case.via, self.case.oldest)):
            out = _read_cs(self._convert(src, f"old{i}", src_fmt, rel, cfg))
            src, src_fmt, cfg = out.mdl, rel, out.yml
        if self.case.oldest[3:] in resolve(self.case.model)[0].hf_style_releases and not self.case.via:
            # A release keyed with HF-style names: whichever route reaches it, the layout is the one
            # the tool's own HF-style writer (cs-1.7 -> cs-1.6) produces.
            ref = _read_cs(self._convert(str(self.root / "hf"), "old_ref", "hf", "cs-1.7"))
            ref = _read_cs(self._convert(ref.mdl, "old_ref2", "cs-1.7", rel, ref.yml))
            if set(out.model) != set(ref.model):
                raise WrongLayout(f"hf -> {rel} keys {sorted(out.model)[:3]} ..., expected {sorted(ref.model)[:3]} ...")
        return out

    @_stage
    def direct(self) -> Out:
        self.original  # noqa: B018
        return _read_cs(self._convert(str(self.root / "hf"), "direct", "hf", NEWEST))

    @_stage
    def up(self) -> Out:
        old = self.old
        return _read_cs(self._convert(old.mdl, "up", self.case.oldest, NEWEST, old.yml))

    @_stage
    def down(self) -> Out:
        d = self.direct
        return _read_cs(self._convert(d.mdl, "down", NEWEST, self.case.oldest, d.yml))

    @_stage
    def back(self) -> dict[str, torch.Tensor]:
        old = self.old
        return load_dir(self._convert(old.mdl, "back", self.case.oldest, "hf", old.yml).target)

    @_stage
    def back_direct(self) -> dict[str, torch.Tensor]:
        d = self.direct
        return load_dir(self._convert(d.mdl, "back_direct", NEWEST, "hf", d.yml).target)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Chain]:
    made: dict[str, Chain] = {}

    def get(case: Case) -> Chain:
        if case.id not in made:
            made[case.id] = Chain(case, tmp_path_factory.mktemp(re.sub(r"[^\w.-]", "_", case.id)))
        return made[case.id]

    return get


# --- helpers ----------------------------------------------------------------------------------------


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) - set(want))[:8], sorted(set(want) - set(got))[:8])
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, (what, k, got[k].dtype, v.dtype)
        assert torch.equal(got[k], v), (what, k)


def releases_between(a: str, b: str) -> list[str]:
    lo, hi = sorted((release_key(a[3:]), release_key(b[3:])))
    path = [f"cs-{r}" for r in RELEASES if lo <= release_key(r) <= hi]
    return path if release_key(a[3:]) <= release_key(b[3:]) else path[::-1]


# Names before the 2.0 -> 2.1 embedding refactor (reference §3.0, §3.14, §5), written out here
# independently of ckptconv.engine.layouts.upgrades: >= 2.1 name -> <= 2.0 name.
OLD_NAMES = [
    (r"(.*)embedding_layer\.position_embeddings\.embed\.weight", r"\1embedding_layer.position_embeddings.weight"),
    (r"(.*)embedding_layer\.position_embeddings\.fpe", r"\1embedding_layer.position_embeddings"),
    (
        r"(.*)embedding_layer\.position_embed_helper\.(slopes|relative_attention_bias\.weight)",
        r"\1relative_pe_helper.\2",
    ),
    (
        r"(.*)(encoder|decoder)_embeddings\.position_embed_helper\.relative_attention_bias\.weight",
        r"\1relative_position_\2.relative_attention_bias.weight",
    ),
]


def in_release(key: str, release: str) -> str:
    """A cs >= 2.1 ``model.`` key as ``release`` names it (not for HF-style releases)."""
    if release_key(release[3:]) >= (2, 1):
        return key
    for pattern, repl in OLD_NAMES:
        new, n = re.subn(f"^{pattern}$", repl, key)
        if n:
            return new
    return key


def model_section(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["trainer"]["init"]["model"] if "trainer" in doc else doc["model"]


def flat(doc: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested document under dotted keys (list items by index), as the checkpoint stores them."""
    if isinstance(doc, dict):
        return {k: v for key, sub in doc.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    if isinstance(doc, list):
        return {k: v for i, sub in enumerate(doc) for k, v in flat(sub, f"{prefix}{i}.").items()}
    return {prefix[:-1]: doc}


def assert_metadata(out: Out, release: str, source: Out | None = None) -> None:
    """The source's ``__metadata__`` records kept, and one record appended: the target release and
    the converted config (reference §1.1)."""
    kept = {k: v for k, v in (source.values if source else {}).items() if k.startswith("__metadata__.")}
    n = len({k.split(".")[1] for k in kept})
    meta = {k: v for k, v in out.values.items() if k.startswith("__metadata__.")}
    assert {k: meta.get(k) for k in kept} == kept
    assert meta[f"__metadata__.{n}.version"] == f"{release[3:]}.0"
    assert meta[f"__metadata__.{n}.model_name"] == ""
    assert not any(k.startswith(f"__metadata__.{n + 1}.") for k in meta)
    head = f"__metadata__.{n}.params."
    params = {k[len(head) :]: v for k, v in meta.items() if k.startswith(head)}
    want = flat(out.config)
    assert params == want and all(type(params[k]) is type(v) for k, v in want.items())


# --- the tests ----------------------------------------------------------------------------------------


def test_every_family_table_has_a_case() -> None:
    covered = {resolve(c.model)[0].name for c in CHAIN_CASES}
    assert covered == set(families()) - set(NOT_COVERED), sorted(set(families()) ^ covered)


@pytest.mark.parametrize("case", cases("upgrade"))
def test_upgrade_equals_direct_import(case: Case, chain: Callable[[Case], Chain]) -> None:
    c = chain(case)
    up, direct = c.up, c.direct
    assert up.path == releases_between(case.oldest, NEWEST)  # one pass over every release edge
    assert_same_tensors(up.model, direct.model, f"{case.oldest} -> {NEWEST} vs hf -> {NEWEST}")


@pytest.mark.parametrize("case", cases("downgrade"))
def test_downgrade_gives_back_the_old_release(case: Case, chain: Callable[[Case], Chain]) -> None:
    c = chain(case)
    down, old = c.down, c.old
    assert down.path == releases_between(NEWEST, case.oldest)  # a downgrade across every release, one pass
    assert_same_tensors(down.model, old.model, f"{NEWEST} -> {case.oldest} vs hf -> {case.oldest}")
    if case.oldest[3:] not in resolve(case.model)[0].hf_style_releases:
        # and that is the cs-2.9 checkpoint under the old release's names
        renamed = {in_release(k, case.oldest): v for k, v in c.direct.model.items()}
        assert_same_tensors(old.model, renamed, f"hf -> {case.oldest} vs hf -> {NEWEST} renamed by the reference")


@pytest.mark.parametrize("case", cases("hf_back"))
def test_old_release_back_to_hf(case: Case, chain: Callable[[Case], Chain]) -> None:
    c = chain(case)
    back, original = c.back, c.original
    for k, v in original.items():
        assert k in back, k
        assert back[k].dtype == v.dtype, k
        if case.inexact is not None and case.inexact(k):
            torch.testing.assert_close(back[k], v, rtol=0, atol=1e-6)
        else:
            assert torch.equal(back[k], v), k
    # Whatever else the export writes (regenerated buffers, tied duplicates) is what a direct
    # cs-2.9 -> hf export writes, bit for bit (this also holds for the inexact Gemma 2 norms).
    assert_same_tensors(back, c.back_direct, f"{case.oldest} -> hf vs {NEWEST} -> hf")


# Keys the cs-2.2 -> 2.3 muP rework rewrites (reference §5 and §6.1): with m = 1 / decoder_kernel,
# output_logits_scale -> output_logits_alpha = output_logits_scale * m, and mup_base_hidden_size /
# mup_base_filter_size = hidden_size / m, filter_size / m. The direct import writes BTLM's native muP
# in its pre-2.3 form for every release (btlm HF_CS21 covers hf <-> 2.1 ... 2.9), so an upgrade from
# before 2.3 differs from it by exactly this rework (the Model Zoo's own CS 2.2 -> 2.3 config step
# reworks any pre-2.3 muP config alike; it is not BTLM-specific).
MUP_REWORK = ("output_logits_scale", "output_logits_alpha", "mup_base_hidden_size", "mup_base_filter_size")


@pytest.mark.parametrize("case", cases("config"))
def test_config_chain(case: Case, chain: Callable[[Case], Chain]) -> None:
    c = chain(case)
    old, up, direct, down = c.old, c.up, c.direct, c.down

    # HF -> CS writes the legacy layout and adds no release record (reference §1.1, §1.5); a step 1
    # that went on through another release is a CS -> CS output, with its record.
    assert "trainer" not in direct.config and "trainer" not in old.config
    assert not any(k.startswith("__metadata__") for k in direct.values)
    if case.via:
        assert_metadata(old, case.oldest)
    else:
        assert not any(k.startswith("__metadata__") for k in old.values)

    # Keys introduced by later releases are absent from the old config (reference §5).
    if release_key(case.oldest[3:]) < (2, 0):
        assert "norm_type" not in model_section(old.config)  # 2.0 turned use_*_norm flags into norm_type
    if release_key(case.oldest[3:]) < (2, 4):
        assert "name" not in model_section(old.config)  # 2.4 added the registry name

    # Upgrading across 2.2 -> 2.3 moves the run file to the trainer layout (reference §5).
    crosses_2_3 = release_key(case.oldest[3:]) < (2, 3)
    assert ("trainer" in up.config) == crosses_2_3
    if crosses_2_3:
        assert "model" not in up.config
    got, want = dict(model_section(up.config)), dict(model_section(direct.config))
    kernel = (direct.config.get("optimizer") or {}).get("adjust_learning_rate", {}).get("decoder_kernel")
    if crosses_2_3 and kernel is not None:  # a muP run (BTLM here): the rework, value for value
        m = 1 / kernel
        assert got.pop("output_logits_alpha") == want.pop("output_logits_scale") * m
        assert got.pop("mup_base_hidden_size") == want["hidden_size"] / m
        assert got.pop("mup_base_filter_size") == want["filter_size"] / m
        assert "adjust_learning_rate" not in str(up.config)  # the width scale was consumed by the rework
    assert not (set(MUP_REWORK) & (set(got) ^ set(want)))
    assert got == want  # includes `name`: added by 2.3 -> 2.4 on the upgrade, written by the import
    assert_metadata(up, NEWEST, source=old)

    # Down again: the step-1 config, whole document, and the record of the release written.
    assert down.config == old.config
    assert_metadata(down, case.oldest, source=direct)
