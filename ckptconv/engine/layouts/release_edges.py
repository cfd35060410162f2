"""The edges of the release graph, one per pair of neighbouring Cerebras releases: the checkpoint
key renames across the edge, whether going up repairs tied pairs, and the config steps that
rewrite a whole run YAML up or down (reference §5). One cohesive table: each edge's steps are
small functions read only by the ``EDGES`` entry that names them, so they stay beside it (the
module is near 500 lines for that reason). The graph and the paths through it are in
:mod:`ckptconv.engine.layouts.upgrades`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptconv.core.errors import ConfigConversionError
from ckptconv.core.releases import RELEASES
from ckptconv.engine.cs_yaml import editable_model_section
from ckptconv.engine.layouts.family import Family

# --- key renames ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Rename:
    """One key rename between the vocabulary below an edge (``old``) and above it (``new``)."""

    old: re.Pattern[str]
    new: re.Pattern[str]
    old_fmt: str
    new_fmt: str

    @classmethod
    def of(cls, old: str, new: str) -> Rename:
        # ``{p}``: any prefix (``bert_encoder.``, ``encoder_``...), ``{s}``: an optional suffix.
        def rx(t: str) -> re.Pattern[str]:
            body = re.escape(t).replace(r"\{p\}", r"(?P<p>(?:.*\.)?)").replace(r"\{x\}", r"(?P<x>[a-z]+)")
            return re.compile(body)

        return cls(rx(old), rx(new), old, new)

    def up(self, key: str) -> str | None:
        m = self.old.fullmatch(key)
        return _fill(self.new_fmt, m.groupdict()) if m else None

    def down(self, key: str) -> str | None:
        m = self.new.fullmatch(key)
        return _fill(self.old_fmt, m.groupdict()) if m else None


def _fill(fmt: str, groups: Mapping[str, str]) -> str:
    return fmt.replace("{p}", groups.get("p") or "").replace("{x}", groups.get("x") or "")


RENAMES_2_0_TO_2_1 = [
    Rename.of("{p}embedding_layer.position_embeddings.weight", "{p}embedding_layer.position_embeddings.embed.weight"),
    Rename.of("{p}embedding_layer.position_embeddings", "{p}embedding_layer.position_embeddings.fpe"),
    Rename.of("{p}relative_pe_helper.slopes", "{p}embedding_layer.position_embed_helper.slopes"),
    Rename.of(
        "{p}relative_pe_helper.relative_attention_bias.weight",
        "{p}embedding_layer.position_embed_helper.relative_attention_bias.weight",
    ),
    # T5: per-stack embeddings and relative position helpers.
    Rename.of("{p}{x}_embeddings.position_embeddings.weight", "{p}{x}_embeddings.position_embeddings.embed.weight"),
    Rename.of("{p}{x}_embeddings.position_embeddings", "{p}{x}_embeddings.position_embeddings.fpe"),
    Rename.of(
        "{p}relative_position_{x}.relative_attention_bias.weight",
        "{p}{x}_embeddings.position_embed_helper.relative_attention_bias.weight",
    ),
]

# Tied pairs repaired going up to 2.0 (and filled from whichever member exists on any read).
TIED_PAIRS = [
    ("lm_head.weight", "embedding_layer.word_embeddings.weight"),
    ("ln_f.weight", "transformer_decoder.norm.weight"),
    ("ln_f.bias", "transformer_decoder.norm.bias"),
]


# --- config steps ----------------------------------------------------------------------------

ConfigStep = Callable[[dict[str, Any], "EdgeCtx"], dict[str, Any]]


@dataclass
class EdgeCtx:
    family: Family
    warnings: list[str] = field(default_factory=list)


def _norm_flag_up(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    m = editable_model_section(doc)
    if "use_rms_norm" in m:
        m["norm_type"] = "rmsnorm" if m.pop("use_rms_norm") else m.get("norm_type", "layernorm")
    if "use_biasless_norm" in m:
        m["norm_type"] = "biasless-layernorm" if m.pop("use_biasless_norm") else m.get("norm_type", "layernorm")
    if "use_t5_layer_norm" in m:
        m["norm_type"] = "rmsnorm" if m.pop("use_t5_layer_norm") else "layernorm"
    return doc


def _norm_flag_down(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    m = editable_model_section(doc)
    nt = m.pop("norm_type", None)
    if nt is None:
        return doc
    fam = ctx.family.name
    if fam == "t5":
        m["use_t5_layer_norm"] = nt == "rmsnorm"
    elif nt == "biasless-layernorm":
        m["use_biasless_norm"] = True
    elif nt == "rmsnorm":
        m["use_rms_norm"] = True
    elif nt != "layernorm":
        raise ConfigConversionError(f"norm_type={nt!r} cannot be expressed before release 2.0")
    return doc


def _bert_heads_up(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    if ctx.family.name not in ("bert", "roberta"):
        return doc
    m = editable_model_section(doc)
    m.setdefault("pooler_nonlinearity", m.get("encoder_nonlinearity", "gelu"))
    m.setdefault("mlm_nonlinearity", "gelu")
    return doc


def _bert_heads_down(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    if ctx.family.name not in ("bert", "roberta"):
        return doc
    m = editable_model_section(doc)
    enc = m.get("encoder_nonlinearity", "gelu")
    if m.get("pooler_nonlinearity", enc) != enc or m.get("mlm_nonlinearity", "gelu") != "gelu":
        raise ConfigConversionError(
            "releases before 1.8 use the encoder nonlinearity for the pooler and gelu for the MLM head; "
            "this config differs"
        )
    m.pop("pooler_nonlinearity", None)
    m.pop("mlm_nonlinearity", None)
    return doc


def _t5_prenorm_flip(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    if ctx.family.name == "t5":
        m = editable_model_section(doc)
        if "use_pre_encoder_decoder_layer_norm" in m:
            m["use_pre_encoder_decoder_layer_norm"] = not m["use_pre_encoder_decoder_layer_norm"]
    return doc


_PAIR_ALIASES = [
    (("beta1", "beta2"), "betas"),
    (("eps1", "eps2"), "eps"),
    (("eta1", "eta2"), "etas"),
    (("step_size_min", "step_size_max"), "step_sizes"),
]
_SCHED_ALIASES = {
    "steps": "total_iters",
    "decay_steps": "total_iters",
    "learning_rate": "initial_learning_rate",
    "base_lr": "initial_learning_rate",
    "values": "learning_rates",
    "boundaries": "milestones",
    "t_max": "T_max",
}
_RUNCONFIG_DROPPED_2_1 = [
    "experimental_api",
    "multireplica",
    "num_replicas",
    "save_losses",
    "service_dir",
    "use_appliance_data",
    "num_act_servers",
    "num_wgt_servers",
]


def _rename_in(d: dict[str, Any], aliases: Mapping[str, str]) -> None:
    for old, new in aliases.items():
        if old in d and new not in d:
            d[new] = d.pop(old)


def _up_2_1(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    m = editable_model_section(doc)
    opt = doc.get("optimizer")
    if isinstance(opt, dict):
        if "weight_decay_rate" in opt and "weight_decay" not in opt:
            opt["weight_decay"] = opt.pop("weight_decay_rate")
        for (a, b), new in _PAIR_ALIASES:
            if a in opt and b in opt and new not in opt:
                opt[new] = [opt.pop(a), opt.pop(b)]
        sched = opt.get("learning_rate")
        for s in sched if isinstance(sched, list) else [sched]:
            if isinstance(s, dict):
                _rename_in(s, _SCHED_ALIASES)
    if "precision_opt_level" in m:
        doc.setdefault("runconfig", {})["precision_opt_level"] = m.pop("precision_opt_level")
    if "use_bfloat16" in m:
        m["fp16_type"] = "bfloat16" if m.pop("use_bfloat16") else "float16"
    rc = doc.get("runconfig")
    if isinstance(rc, dict):
        for k in _RUNCONFIG_DROPPED_2_1:
            rc.pop(k, None)
        if rc.pop("is_pretrained_checkpoint", False):
            rc["load_checkpoint_states"] = "model,dataloader"
        if "keep_checkpoint_max" in rc:
            rc["max_checkpoints"] = rc.pop("keep_checkpoint_max")
    doc.pop("csconfig", None)
    return doc


def _down_2_1(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    m = editable_model_section(doc)
    fp16 = m.pop("fp16_type", None)
    if fp16 is not None:
        m["use_bfloat16"] = fp16 in ("bfloat16", "cbfloat16")
    rc = doc.get("runconfig")
    if isinstance(rc, dict):
        if "precision_opt_level" in rc:
            m["precision_opt_level"] = rc.pop("precision_opt_level")
        if "max_checkpoints" in rc:
            rc["keep_checkpoint_max"] = rc.pop("max_checkpoints")
    opt = doc.get("optimizer")
    if isinstance(opt, dict):
        for (a, b), new in _PAIR_ALIASES:
            if isinstance(opt.get(new), list) and len(opt[new]) == 2:
                opt[a], opt[b] = opt.pop(new)
    return doc


def _up_2_2(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    rc = doc.get("runconfig")
    if isinstance(rc, dict):
        if "use_cs_grad_accum" in rc:
            accum = rc.pop("use_cs_grad_accum")
            for section in ("train_input", "eval_input"):
                if isinstance(doc.get(section), dict):
                    if not accum:
                        doc[section]["micro_batch_size"] = None
                    else:
                        doc[section].setdefault("micro_batch_size", "auto")
        rc.pop("autogen_policy", None)
    sp = doc.get("sparsity")
    if isinstance(sp, dict):
        _sparsity_up(sp)
    return doc


def _sparsity_up(sp: dict[str, Any]) -> None:
    if "type" in sp:
        kind = sp.pop("type")
        if kind != "static":
            sp["algorithm"] = kind
    if "schedule" in sp and "update" not in sp:
        sp["update"] = sp.pop("schedule")
    if "sparsity_schedule" in sp:
        sp["schedule"] = sp.pop("sparsity_schedule")
    if isinstance(sp.get("update"), int):
        n = sp.pop("update")
        if n != 1:
            sp["update"] = {"freq": n}
    pats = sp.pop("param_name_patterns", None)
    if pats is not None:
        if isinstance(pats, str):
            sp["param_filter"] = pats.replace(".*", "*")
        elif isinstance(pats, dict):
            sp["groups"] = [{"param_filter": k.replace(".*", "*"), **(v or {})} for k, v in pats.items()]
        else:
            sp["param_filter"] = [p.replace(".*", "*") for p in pats]


def _down_2_2(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    for section in ("train_input", "eval_input"):
        s = doc.get(section)
        if isinstance(s, dict) and "micro_batch_size" in s:
            mbs = s.pop("micro_batch_size")
            doc.setdefault("runconfig", {})["use_cs_grad_accum"] = mbs is not None
    return doc


# Legacy section -> trainer layout (2.3). Sections not listed stay where the trainer reads them.
def _up_2_3(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    if "trainer" in doc:
        return doc
    m = dict(doc.pop("model", {}) or {})
    if ctx.family.name == "gpt2":
        for k in ("use_position_embedding", "alibi_implementation", "weight_initialization_seed"):
            m.pop(k, None)
    _mup_rework(m, doc, ctx)
    init: dict[str, Any] = {"backend": {"backend_type": "CSX"}, "model": m}
    opt = doc.pop("optimizer", None)
    if isinstance(opt, dict):
        opt = dict(opt)
        kind = opt.pop("optimizer_type", "AdamW")
        sched = opt.pop("learning_rate", None)
        for k in (
            "loss_scaling_factor",
            "max_gradient_norm",
            "initial_loss_scale",
            "steps_per_increase",
            "min_loss_scale",
            "max_loss_scale",
            "log_summaries",
        ):
            if k in opt:
                init.setdefault("precision", {})[k] = opt.pop(k)
        init["optimizer"] = {kind: opt}
        if isinstance(sched, int | float):
            init["optimizer"][kind]["lr"] = sched
        elif sched is not None:
            init["schedulers"] = sched if isinstance(sched, list) else [sched]
    rc = dict(doc.pop("runconfig", {}) or {})
    if "fp16_type" in m:
        init.setdefault("precision", {})["fp16_type"] = m.pop("fp16_type")
    if "mixed_precision" in m:
        init.setdefault("precision", {})["enabled"] = m.pop("mixed_precision")
    loop = {k: rc.pop(k) for k in ("max_steps", "num_steps", "num_epochs", "eval_steps", "eval_frequency") if k in rc}
    if loop:
        init["loop"] = loop
    if "checkpoint_steps" in rc:
        init["checkpoint"] = {"steps": rc.pop("checkpoint_steps")}
    if "log_steps" in rc:
        init["logging"] = {"log_steps": rc.pop("log_steps")}
    if "seed" in rc:
        init["seed"] = rc.pop("seed")
    if "model_dir" in rc:
        init["model_dir"] = rc.pop("model_dir")
    cluster = {k: rc.pop(k) for k in ("num_csx", "mount_dirs", "python_paths") if k in rc}
    if cluster:
        init["backend"]["cluster_config"] = cluster
    if rc:
        ctx.warnings.append(
            "runconfig keys without a place in the 2.3 trainer layout were dropped: " + ", ".join(sorted(rc))
        )
    if isinstance(doc.get("sparsity"), dict):
        init["sparsity"] = doc.pop("sparsity")
    fit: dict[str, Any] = {}
    if "train_input" in doc:
        fit["train_dataloader"] = doc.pop("train_input")
    if "eval_input" in doc:
        fit["val_dataloader"] = doc.pop("eval_input")
    trainer: dict[str, Any] = {"init": init}
    if fit:
        trainer["fit"] = fit
    out = {"trainer": trainer}
    out.update(doc)  # sections the trainer layout does not own are kept as they were
    return out


def _mup_rework(m: dict[str, Any], doc: dict[str, Any], ctx: EdgeCtx) -> None:
    """cs-2.2 -> 2.3 muP config rework (reference §6.1)."""
    opt = doc.get("optimizer") if isinstance(doc.get("optimizer"), dict) else {}
    adjust = opt.get("adjust_learning_rate") if isinstance(opt, dict) else None
    if not isinstance(adjust, dict) or "decoder_kernel" not in adjust:
        return
    m_scale = 1.0 / float(adjust.pop("decoder_kernel"))
    if not adjust:
        opt.pop("adjust_learning_rate")
    for key in ("initializer", "output_layer_initializer"):
        init = m.get(key)
        if not isinstance(init, dict) or "std" not in init:
            continue
        factor = math.sqrt(m_scale)
        if key == "output_layer_initializer":
            factor *= math.sqrt(2 * int(m.get("num_hidden_layers", 1)))
        std = init["std"]
        init["std"] = std * factor
        if init.get("name") == "truncated_normal":
            init["a"] = init.get("a", -2 * std) * factor
            init["b"] = init.get("b", 2 * std) * factor
    if "output_logits_scale" in m:
        m["output_logits_alpha"] = m.pop("output_logits_scale") * m_scale
    if "hidden_size" in m:
        m["mup_base_hidden_size"] = m["hidden_size"] / m_scale
    if "filter_size" in m:
        m["mup_base_filter_size"] = m["filter_size"] / m_scale


def _down_2_3(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    if "trainer" not in doc:
        return doc
    trainer = doc.pop("trainer")
    if isinstance(trainer, list):
        raise ConfigConversionError("a list of trainers cannot be expressed before release 2.3")
    init = dict(trainer.get("init") or {})
    fit = dict(trainer.get("fit") or {})
    out: dict[str, Any] = {}
    m = dict(init.pop("model", {}) or {})
    m.pop("name", None)
    if any(k.startswith("mup_base_") for k in m):
        raise ConfigConversionError(
            "a muP config (mup_base_*) cannot be moved below release 2.3 exactly",
            hint="convert to Hugging Face first (muP is folded into the weights), or stay at 2.3+",
        )
    precision = init.pop("precision", {}) or {}
    if "fp16_type" in precision:
        m["fp16_type"] = precision.pop("fp16_type")
    if "enabled" in precision:
        m["mixed_precision"] = precision.pop("enabled")
    out["model"] = m
    opt = init.pop("optimizer", None)
    if isinstance(opt, dict) and len(opt) == 1:
        kind, params = next(iter(opt.items()))
        o = {"optimizer_type": kind, **(params or {})}
        scheds = init.pop("schedulers", None)
        if scheds is not None:
            o["learning_rate"] = scheds
        elif "lr" in o:
            o["learning_rate"] = o.pop("lr")
        o.update(precision)
        out["optimizer"] = o
    rc: dict[str, Any] = {}
    rc.update(init.pop("loop", {}) or {})
    if "checkpoint" in init and "steps" in (init["checkpoint"] or {}):
        rc["checkpoint_steps"] = init.pop("checkpoint")["steps"]
    if "logging" in init and "log_steps" in (init["logging"] or {}):
        rc["log_steps"] = init.pop("logging")["log_steps"]
    for k in ("seed", "model_dir"):
        if k in init:
            rc[k] = init.pop(k)
    rc.update((init.get("backend") or {}).get("cluster_config") or {})
    if rc:
        out["runconfig"] = rc
    if "sparsity" in init:
        out["sparsity"] = init.pop("sparsity")
    if "train_dataloader" in fit:
        out["train_input"] = fit["train_dataloader"]
    if "val_dataloader" in fit:
        out["eval_input"] = fit["val_dataloader"]
    out.update(doc)
    return out


def _up_2_4(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    m = editable_model_section(doc)
    m.setdefault("name", ctx.family.cs_name)
    return doc


def _identity(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    return doc


def _remove_name(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
    editable_model_section(doc).pop("name", None)
    return doc


@dataclass(frozen=True)
class Edge:
    lo: str
    hi: str
    renames: tuple[Rename, ...] = ()
    repair_ties: bool = False
    config_up: ConfigStep = _identity
    config_down: ConfigStep = _identity
    note: str = ""


def _chain(*steps: ConfigStep) -> ConfigStep:
    def run(doc: dict[str, Any], ctx: EdgeCtx) -> dict[str, Any]:
        for s in steps:
            doc = s(doc, ctx)
        return doc

    return run


EDGES: dict[tuple[str, str], Edge] = {
    (e.lo, e.hi): e
    for e in [
        Edge("1.6", "1.7", note="BERT/T5 1.6 used Hugging Face style names"),
        Edge(
            "1.7",
            "1.8",
            config_up=_chain(_bert_heads_up, _t5_prenorm_flip),
            config_down=_chain(_bert_heads_down, _t5_prenorm_flip),
        ),
        Edge("1.8", "1.9"),
        Edge(
            "1.9",
            "2.0",
            repair_ties=True,
            config_up=_norm_flag_up,
            config_down=_norm_flag_down,
            note="tied weights repaired",
        ),
        Edge(
            "2.0",
            "2.1",
            renames=tuple(RENAMES_2_0_TO_2_1),
            config_up=_up_2_1,
            config_down=_down_2_1,
            note="embedding refactor",
        ),
        Edge("2.1", "2.2", config_up=_up_2_2, config_down=_down_2_2),
        Edge("2.2", "2.3", config_up=_up_2_3, config_down=_down_2_3, note="trainer layout, muP rework"),
        Edge("2.3", "2.4", config_up=_up_2_4, config_down=_remove_name),
        *[
            Edge(a, b)
            for a, b in zip(RELEASES[RELEASES.index("2.4") :], RELEASES[RELEASES.index("2.5") :], strict=False)
        ],
    ]
}
