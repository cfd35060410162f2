"""Config hooks of one family each (GPT-2, GPT-NeoX, GPT-J, CodeGen, Falcon, BLOOM, MPT, BTLM, BERT,
RoBERTa, T5, Gemma 2): the part of a family's config conversion its table cannot say as data,
beside the hooks several families share (:mod:`ckptconv.engine.layouts.hooks`).
"""

from __future__ import annotations

import math
from typing import Any

from ckptconv.engine.layouts.dictpath import get_path
from ckptconv.engine.layouts.hooks import Ctx, fail, hook


@hook("gpt2_filter_size")
class _Gpt2Filter:
    """n_inner (null means 4 x n_embd) <-> filter_size; export always writes n_inner explicitly."""

    reads = ("n_inner", "n_embd")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        n_inner = hf.get("n_inner")
        cs["filter_size"] = int(n_inner) if n_inner is not None else 4 * int(hf["n_embd"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        if "filter_size" in cs:
            hf["n_inner"] = cs["filter_size"]


@hook("gpt2_dropouts")
class _Gpt2Dropouts:
    """Absent embedding / attention dropouts default to dropout_rate on export."""

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        return None

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        if "dropout_rate" in cs:
            hf.setdefault("embd_pdrop", cs["dropout_rate"])
            hf.setdefault("attn_pdrop", cs["dropout_rate"])


@hook("neox_rotary")
class _NeoxRotary:
    """rotary_pct <-> rotary_dim = int(head_dim x pct); rotary_emb_base must be 10000."""

    reads = ("rotary_pct", "partial_rotary_factor", "rotary_emb_base", "rope_theta")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pct = hf.get("rotary_pct", hf.get("partial_rotary_factor", 0.25))
        base = hf.get("rotary_emb_base", hf.get("rope_theta", 10000))
        if float(base) != 10000.0:
            raise fail(f"Can't convert config with rotary_emb_base={base}. Only 10000 is supported.")
        cs["rotary_dim"] = int((hf["hidden_size"] // hf["num_attention_heads"]) * pct)

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        head = cs["hidden_size"] // cs["num_heads"]
        hf["rotary_pct"] = cs.get("rotary_dim", head) / head
        hf["rotary_emb_base"] = 10000


@hook("gptj_rotary_flag")
class _GptjRotary:
    """CS position_embedding_type (if stated) must be rotary; GPT-J exports it as HF `rotary: true`."""

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        return None

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pe = cs.get("position_embedding_type")
        if pe is None:
            return
        if pe != "rotary":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'rotary' is supported.")
        if ctx.param("export_rotary_flag", True):
            hf["rotary"] = True


@hook("codegen_heads")
class _CodegenHeads:
    """CodeGen's fused qkv is split in mp_num = 4 shards: fewer than 4 heads cannot be converted."""

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        if int(hf.get("n_head", 16)) < 4:
            raise fail(f"Can't convert CodeGen with n_head={hf.get('n_head')}; at least 4 heads are needed (mp_num=4)")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        if int(cs.get("num_heads", 16)) < 4:
            raise fail(f"Can't convert CodeGen with num_heads={cs.get('num_heads')}; at least 4 heads are needed")


@hook("falcon")
class _Falcon:
    """Falcon's attention layout flags (reference §4.4), modern and legacy HF configs."""

    reads = (
        "alibi",
        "bias",
        "new_decoder_architecture",
        "parallel_attn",
        "multi_query",
        "num_kv_heads",
        "num_ln_in_parallel_attn",
        "n_head",
        "n_layer",
        "n_head_kv",
        "model_type",
    )

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        legacy = hf.get("model_type") in ("RefinedWebModel", "RefinedWeb") or "n_head" in hf
        heads = hf.get("num_attention_heads", hf.get("n_head"))
        if legacy:
            cs["num_heads"] = heads
            if "n_layer" in hf:
                cs["num_hidden_layers"] = hf["n_layer"]
        if hf.get("alibi"):
            raise fail("Can't convert config with alibi=True. Only rotary Falcon models are supported.")
        if legacy and hf.get("bias"):
            raise fail("Can't convert legacy Falcon config with bias=True.")
        bias = bool(hf.get("bias", False))
        new = bool(hf.get("new_decoder_architecture", False))
        parallel = bool(hf.get("parallel_attn", True))
        if legacy and "n_head_kv" in hf:  # RefinedWeb (40B)
            new, kv = True, hf["n_head_kv"]
            if not parallel:
                raise fail("Can't convert RefinedWeb config with parallel_attn=False.")
            untied = True
        elif legacy:  # RefinedWebModel (7B)
            if not hf.get("multi_query", True):
                raise fail("Can't convert RefinedWebModel config with multi_query=False.")
            kv, untied = 1, False
        else:
            if not new and hf.get("multi_query", True):
                kv = 1
            elif not new:
                kv = heads
            else:
                kv = hf.get("num_kv_heads", heads)
            untied = (new and hf.get("num_ln_in_parallel_attn", 2) == 2) or not parallel
        cs["use_projection_bias_in_attention"] = bias
        cs["use_ffn_bias_in_attention"] = bias
        cs["use_ffn_bias"] = bias
        cs["position_embedding_type"] = "rotary"
        cs["rotary_dim"] = int(hf["hidden_size"] // heads)
        cs["use_untied_layer_norm"] = bool(untied)
        cs["attention_module"] = "multiquery_attention"
        cs["extra_attention_params"] = {"num_kv_groups": kv}
        cs["filter_size"] = 4 * int(hf["hidden_size"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        heads, hidden = cs["num_heads"], cs["hidden_size"]
        if cs.get("embedding_dropout_rate", 0.0) not in (0, 0.0, None):
            raise fail("Can't convert config with embedding_dropout_rate != 0. Only 0.0 is supported.")
        if cs.get("rotary_dim", hidden // heads) != hidden // heads:
            raise fail(f"Can't convert config with rotary_dim={cs.get('rotary_dim')}. Only {hidden // heads}.")
        if cs.get("filter_size", 4 * hidden) != 4 * hidden:
            raise fail(f"Can't convert config with filter_size={cs.get('filter_size')}. Only {4 * hidden}.")
        flags = {
            cs.get(k, True) for k in ("use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias")
        }
        if len(flags) != 1:
            raise fail("Falcon needs the three bias flags (attention projections, attention output, FFN) to be equal")
        kv = get_path(cs, "extra_attention_params.num_kv_groups", 1)
        hf["num_kv_heads"] = kv
        hf["alibi"] = False
        # The Model Zoo writes the CS flag names, which transformers ignores (so a biased Falcon
        # would reload without its biases): `bias` is written as well so HF matches the weights.
        for k in ("use_projection_bias_in_attention", "use_ffn_bias_in_attention", "use_ffn_bias"):
            hf[k] = cs.get(k, True)
        hf["bias"] = bool(flags.pop())
        hf["parallel_attn"] = True
        if cs.get("use_untied_layer_norm", False):
            hf["new_decoder_architecture"] = True
            hf["multi_query"] = kv == 1
            hf["num_ln_in_parallel_attn"] = 2
        else:
            hf["new_decoder_architecture"] = False
            if kv == 1:
                hf["multi_query"] = True
            elif kv == heads:
                hf["multi_query"] = False
            else:
                raise fail(f"Falcon with tied layer norms needs num_kv_groups 1 or {heads}, got {kv}")
            hf["num_ln_in_parallel_attn"] = None


@hook("bloom")
class _Bloom:
    """n_embed (legacy) overrides hidden_size; filter_size is 4 x hidden; CS has no max positions."""

    reads = ("n_embed",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        if hf.get("n_embed") is not None:
            cs["hidden_size"] = hf["n_embed"]
        cs["filter_size"] = 4 * int(cs["hidden_size"])

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        hidden = cs["hidden_size"]
        if cs.get("filter_size", 4 * hidden) != 4 * hidden:
            raise fail(f"Can't convert config with filter_size={cs.get('filter_size')}. Only {4 * hidden}.")
        inner = cs.get("attention_inner_dim")
        if inner not in (None, hidden):
            raise fail(f"Can't convert config with attention_inner_dim={inner}. Only null or {hidden}.")
        emb_drop = cs.get("embedding_dropout_rate", cs.get("dropout_rate", 0.0))
        if emb_drop not in (0, 0.0, None):
            raise fail("Can't convert config with embedding_dropout_rate != 0. Only 0.0 is supported.")


@hook("mpt")
class _Mpt:
    """MPT: ALiBi only, no biases, expansion_ratio x d_model feed-forward, unscaled logits."""

    reads = (
        "attn_config",
        "no_bias",
        "expansion_ratio",
        "norm_type",
        "logit_scale",
        "learned_pos_emb",
        "embedding_fraction",
    )

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        attn = hf.get("attn_config") or {}
        checks = {
            "attn_config.alibi": (attn.get("alibi", False), True),
            "attn_config.clip_qkv": (attn.get("clip_qkv"), None),
            "attn_config.qk_ln": (attn.get("qk_ln", False), False),
            "attn_config.softmax_scale": (attn.get("softmax_scale"), None),
            "attn_config.prefix_lm": (attn.get("prefix_lm", False), False),
            "no_bias": (hf.get("no_bias", True), True),
            "logit_scale": (hf.get("logit_scale"), None),
            "embedding_fraction": (hf.get("embedding_fraction", 1.0), 1.0),
        }
        for key, (have, want) in checks.items():
            if have != want:
                raise fail(f"Can't convert config with {key}={have!r}. Only {want!r} is supported.", key=key)
        cs["filter_size"] = int(hf.get("expansion_ratio", 4) * hf["d_model"])
        bias_max = attn.get("alibi_bias_max", 8)
        if bias_max != 8:
            raise fail(f"Can't convert config with attn_config.alibi_bias_max={bias_max}. Only 8 is supported.")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        hidden = int(cs["hidden_size"])
        filt = int(cs.get("filter_size", 4 * hidden))
        if filt % hidden:
            raise fail(f"filter_size={filt} is not a multiple of hidden_size={hidden}; MPT needs an integer ratio")
        hf["expansion_ratio"] = filt // hidden
        attn = hf.setdefault("attn_config", {})
        attn.update({"alibi": True, "alibi_bias_max": 8})
        hf["no_bias"] = True


@hook("btlm_mup")
class _BtlmMup:
    """BTLM/JAIS native muP: output_logits_scale = mup_output_alpha x mup_width_scale; the width
    scale lives in the CS run YAML as optimizer.adjust_learning_rate.decoder_kernel."""

    reads = ("mup_output_alpha", "mup_width_scale")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        alpha, width = hf.get("mup_output_alpha"), hf.get("mup_width_scale")
        if alpha is not None and width is not None:
            cs["output_logits_scale"] = alpha * width
        if width is not None:
            ctx.top.setdefault("optimizer", {}).setdefault("adjust_learning_rate", {})["decoder_kernel"] = width

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        scale = cs.get("output_logits_scale")
        width = get_path(ctx.top, "optimizer.adjust_learning_rate.decoder_kernel", None)
        if width is None:
            width = get_path(ctx.top, "trainer.init.optimizer.adjust_learning_rate.decoder_kernel", None)
        if width is not None:
            hf["mup_width_scale"] = width
            if scale is not None:
                hf["mup_output_alpha"] = scale / width
        elif scale is not None:
            hf["mup_output_alpha"] = scale
            hf["mup_width_scale"] = 1.0


@hook("bert")
class _Bert:
    """BERT/RoBERTa heads: pooler and MLM nonlinearities; position embedding type."""

    reads = ("position_embedding_type",)

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pe = hf.get("position_embedding_type", "absolute")
        if pe != "absolute":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'absolute' is supported.")
        cs["position_embedding_type"] = "learned"
        cs["pooler_nonlinearity"] = "tanh"
        cs.setdefault("mlm_nonlinearity", cs.get("encoder_nonlinearity", "gelu"))

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pe = cs.get("position_embedding_type", "learned")
        if pe != "learned":
            raise fail(f"Can't convert config with position_embedding_type={pe!r}. Only 'learned' is supported.")
        hf["position_embedding_type"] = "absolute"
        enc = cs.get("encoder_nonlinearity", "gelu")
        pooler = cs.get("pooler_nonlinearity")
        if pooler is None and enc != "tanh":
            raise fail("pooler_nonlinearity is absent and encoder_nonlinearity is not tanh: cannot express in HF")
        if pooler not in (None, "tanh"):
            raise fail(f"Can't convert config with pooler_nonlinearity={pooler!r}. Only 'tanh' is supported.")
        mlm = cs.get("mlm_nonlinearity")
        if mlm not in (None, enc) and not ctx.param("mlm_gelu"):
            raise fail(f"Can't convert config with mlm_nonlinearity={mlm!r}. Only the encoder nonlinearity ({enc}).")


@hook("roberta")
class _Roberta:
    """RoBERTa: CS max positions exclude the padding offset; type_vocab_size <-> num_segments."""

    reads = ("pad_token_id", "type_vocab_size", "max_position_embeddings")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        pad = int(hf.get("pad_token_id", 1))
        cs["max_position_embeddings"] = int(hf["max_position_embeddings"]) - pad - 1
        cs["pad_token_id"] = pad
        cs["num_segments"] = hf.get("type_vocab_size", 1)

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        pad = int(cs.get("pad_token_id", 1))
        hf["max_position_embeddings"] = int(cs["max_position_embeddings"]) + pad + 1
        hf["pad_token_id"] = pad
        seg = cs.get("num_segments")
        hf["type_vocab_size"] = seg if seg else 1


@hook("t5")
class _T5:
    """T5: feed_forward_proj <-> encoder/decoder nonlinearity; export checks they agree."""

    reads = ("feed_forward_proj", "relative_attention_max_distance", "scale_decoder_outputs")

    _GATED = {"gated-silu": "swiglu", "gated-relu": "reglu", "gated-gelu": "geglu"}

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        proj = hf.get("feed_forward_proj", "relu")
        act = _T5._GATED.get(proj, proj)
        cs["encoder_nonlinearity"] = act
        cs["decoder_nonlinearity"] = act
        # transformers 5 always ties the T5 head and says with `scale_decoder_outputs` what 4.x said
        # with `tie_word_embeddings` (scale the decoder output by d_model^-0.5, as a shared head needs).
        if "scale_decoder_outputs" in hf:
            cs["share_embedding_weights"] = bool(hf["scale_decoder_outputs"])
        if hf.get("relative_attention_max_distance", 128) != 128:
            raise fail("Can't convert config with relative_attention_max_distance != 128.")

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        enc = cs.get("encoder_nonlinearity", "relu")
        dec = cs.get("decoder_nonlinearity", enc)
        if enc != dec:
            raise fail(f"encoder_nonlinearity={enc!r} and decoder_nonlinearity={dec!r} differ; HF T5 has one")
        inverse = {v: k for k, v in _T5._GATED.items()}
        hf["feed_forward_proj"] = inverse.get(enc, enc)
        tgt = cs.get("tgt_vocab_size")
        if tgt is not None and tgt != cs.get("src_vocab_size"):
            raise fail("tgt_vocab_size differs from src_vocab_size; HF T5 shares one vocabulary")
        relu_drop = cs.get("relu_dropout_rate")
        if relu_drop is not None and relu_drop != cs.get("dropout_rate"):
            raise fail("relu_dropout_rate differs from dropout_rate; HF T5 has one dropout rate")


@hook("gemma2")
class _Gemma2:
    """Gemma 2: attention inner dim, embeddings scale, query pre-attention scalar."""

    reads = ("head_dim", "query_pre_attn_scalar", "attention_bias")

    @staticmethod
    def to_cs(hf: dict[str, Any], cs: dict[str, Any], ctx: Ctx) -> None:
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        cs["attention_inner_dim"] = head_dim * heads
        cs["rotary_dim"] = head_dim
        cs["embeddings_scale"] = math.sqrt(hf["hidden_size"])
        q = hf.get("query_pre_attn_scalar", head_dim)
        if q != head_dim:
            cs["attention_logits_alpha"] = math.sqrt(head_dim / q)
        bias = bool(hf.get("attention_bias", False))
        cs["use_projection_bias_in_attention"] = bias
        cs["use_ffn_bias_in_attention"] = bias

    @staticmethod
    def to_hf(cs: dict[str, Any], hf: dict[str, Any], ctx: Ctx) -> None:
        heads = cs["num_heads"]
        head_dim = int((cs.get("attention_inner_dim") or cs["hidden_size"]) // heads)
        hf["head_dim"] = head_dim
        want = math.sqrt(cs["hidden_size"])
        if not math.isclose(float(cs.get("embeddings_scale", want)), want, rel_tol=1e-6):
            raise fail(f"Can't convert config with embeddings_scale={cs.get('embeddings_scale')}. Only sqrt(hidden).")
        alpha = cs.get("attention_logits_alpha") or 1.0
        hf["query_pre_attn_scalar"] = head_dim / alpha**2
        if float(hf["query_pre_attn_scalar"]).is_integer():
            hf["query_pre_attn_scalar"] = int(hf["query_pre_attn_scalar"])
        if cs.get("rotary_dim", head_dim) != head_dim:
            raise fail(f"Can't convert config with rotary_dim={cs.get('rotary_dim')}. Only {head_dim}.")
        hf["attention_bias"] = bool(cs.get("use_projection_bias_in_attention", False))
