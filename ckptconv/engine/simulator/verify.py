"""Compare a Hugging Face model with the Cerebras-side model of a converted checkpoint, logit for logit.

``verify(hf_dir, cs_ckpt, cs_config, model)`` runs both on the same deterministic inputs and
reports, per output (LM logits, MLM/NSP logits, classifier logits, ...), the maximum absolute
difference, the maximum relative difference (the absolute difference divided by the largest
Hugging Face logit magnitude), and the cosine similarity, with a verdict against ``tolerance``
(absolute, default 1e-5 in float32; ``rtol`` adds ``rtol * max|hf|``).

Both models compute in float32: a bfloat16 checkpoint is upcast when loaded, and the Hugging Face
model is loaded with ``dtype=float32``, so both see the same (bf16-representable) weights.
The models are held one at a time: the Hugging Face outputs are computed and the model freed
before the Cerebras model is built.
"""

from __future__ import annotations

import contextlib
import gc
import posixpath
import shutil
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckptconv.core.errors import InvalidRequest, SimulationError
from ckptconv.core.uri import as_prefix
from ckptconv.engine.cs_yaml import read_cs_yaml
from ckptconv.engine.simulator import config as cfg
from ckptconv.engine.simulator.checkpoint_io import open_checkpoint
from ckptconv.engine.simulator.config import CsModelConfig, parse_model_config
from ckptconv.engine.simulator.loading import load_model_state
from ckptconv.engine.simulator.models import build_model
from ckptconv.storage import is_local, local_path_of, open_storage, scratch

DEFAULT_TOLERANCE = 1e-5
# Models that convert but have no simulator model: verify reports them skipped, with the way on.
NOT_SIMULATED = {
    "dpo": "the simulator has no DPO model (policy + reference); convert the DPO checkpoint to hf "
    "and verify the language model with its own name",
    "dpr": "the simulator has no DPR model; each encoder is a BERT encoder converted by the bert table",
    "clip-vit": "the simulator has no ViT model; the conversion is checked tensor by tensor and against "
    "transformers' CLIPVisionModel in the test suite",
    "llava": "the simulator has no LLaVA model; its language model is a Llama converted by the llama table "
    "(verify text_model/ with --model llama) and its vision tower a CLIP ViT converted by the clip-vit table",
}

# Model Zoo name -> (transformers class, headless transformers class)
HF_CLASSES: dict[str, tuple[str, str | None]] = {
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "mistral": ("MistralForCausalLM", "MistralModel"),
    "mixtral": ("MixtralForCausalLM", "MixtralModel"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "gptj": ("GPTJForCausalLM", "GPTJModel"),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXModel"),
    "codegen": ("CodeGenForCausalLM", "CodeGenModel"),
    "falcon": ("FalconForCausalLM", "FalconModel"),
    "bloom": ("BloomForCausalLM", "BloomModel"),
    "starcoder": ("GPTBigCodeForCausalLM", "GPTBigCodeModel"),
    "gemma2": ("Gemma2ForCausalLM", None),
    "bert": ("BertForPreTraining", None),
    "roberta": ("RobertaForMaskedLM", None),
    "bert-sequence-classifier": ("BertForSequenceClassification", None),
    "bert-token-classifier": ("BertForTokenClassification", None),
    "bert-qa": ("BertForQuestionAnswering", None),
    "t5": ("T5ForConditionalGeneration", None),
}
ALIASES = {
    "llamaV2": "llama",
    "code-llama": "llama",
    "wizardlm": "llama",
    "octocoder": "starcoder",
    "wizardcoder": "starcoder",
    "sqlcoder": "starcoder",
    "ul2": "t5",
    "flan-ul2": "t5",
    "transformer": "t5",
}
# Families whose Hugging Face implementation is remote code (trust_remote_code), which verify
# never downloads or executes.
REMOTE_CODE = {"santacoder", "btlm", "jais"}

# CS output name -> HF output attribute, per CS class.
OUTPUT_NAMES: dict[str, dict[str, str]] = {
    cfg.GPT2: {"logits": "logits"},
    cfg.GPTJ: {"logits": "logits"},
    cfg.BERT: {"mlm_logits": "prediction_logits", "nsp_logits": "seq_relationship_logits"},
    cfg.BERT_SEQ: {"logits": "logits"},
    cfg.BERT_TOKEN: {"logits": "logits"},
    cfg.BERT_QA: {"start_logits": "start_logits", "end_logits": "end_logits"},
    cfg.T5: {"logits": "logits"},
}


def hf_class_for(model: str) -> tuple[str, bool]:
    """(transformers class name, headless) for a Model Zoo model name."""
    headless = model.endswith("-headless")
    base = model.removesuffix("-headless")
    base = ALIASES.get(base, base)
    if base in REMOTE_CODE:
        raise SimulationError(
            f"verify cannot run the Hugging Face side of {model!r}: its transformers implementation is "
            "remote code (trust_remote_code), which ckptconv never downloads or executes",
            hint="the simulator still loads and runs the Cerebras checkpoint (simulate); compare with a "
            "local copy of the remote model yourself",
        )
    if base not in HF_CLASSES:
        raise SimulationError(f"verify does not know the Hugging Face class for {model!r}")
    full, head = HF_CLASSES[base]
    if headless:
        if head is None:
            raise SimulationError(f"{model!r}: no headless Hugging Face class")
        return head, True
    return full, False


def make_inputs(config: CsModelConfig, *, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic inputs: token ids from a seeded generator (never a pad id where pads matter)."""
    p = config.params
    g = torch.Generator().manual_seed(seed)
    if config.class_name == cfg.T5:
        vocab = int(p["src_vocab_size"])
        seq = min(seq_len, int(p["src_max_position_embeddings"]))
        return {
            "input_ids": torch.randint(0, vocab, (batch_size, seq), generator=g),
            "decoder_input_ids": torch.randint(0, int(p["tgt_vocab_size"]), (batch_size, seq), generator=g),
        }
    vocab = int(p["vocab_size"])
    max_pos = p.get("max_position_embeddings")
    seq = min(seq_len, int(max_pos)) if max_pos else seq_len
    ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
    inputs = {"input_ids": ids}
    if config.class_name in (cfg.BERT, cfg.BERT_SEQ, cfg.BERT_TOKEN, cfg.BERT_QA):
        pad = p.get("pad_token_id")
        if p.get("mask_padding_in_positional_embed") and pad is not None:
            ids[ids == pad] = (pad + 1) % vocab
        inputs["segment_ids"] = torch.zeros_like(ids)
    return inputs


# Files of a Hugging Face model directory that loading needs; nothing else is copied from a remote one.
_HF_FILE_SUFFIXES = (".json", ".safetensors", ".bin")


@contextlib.contextmanager
def local_hf_dir(uri: str) -> Iterator[str]:
    """``uri`` itself when local; an ``s3://`` prefix is copied (streamed, file by file) to a temporary
    directory first, because ``transformers`` loads from the filesystem only."""
    if is_local(uri):
        yield local_path_of(uri)
        return
    storage = open_storage(uri)
    prefix = as_prefix(uri)
    with scratch.directory("hf") as tmp_dir:
        tmp = str(tmp_dir)
        copied = 0
        for info in storage.list(prefix):
            name = info.uri[len(prefix) :]
            if "/" in name or not name.endswith(_HF_FILE_SUFFIXES):
                continue
            with storage.open_reader(info.uri) as src, open(posixpath.join(tmp, name), "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            copied += 1
        if not copied:
            raise InvalidRequest(f"no Hugging Face model files under {uri}", hint="point --hf at the model's directory")
        yield tmp


def _hf_forward(hf_dir: str, class_name: str, headless: bool, inputs: Mapping[str, torch.Tensor]) -> dict:
    import transformers

    klass = getattr(transformers, class_name, None)
    if klass is None:
        raise SimulationError(f"transformers {transformers.__version__} has no {class_name}")
    model = klass.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True, attn_implementation="eager")
    model.eval()
    kwargs: dict[str, Any] = {"input_ids": inputs["input_ids"]}
    if "decoder_input_ids" in inputs:
        kwargs["decoder_input_ids"] = inputs["decoder_input_ids"]
    if "segment_ids" in inputs:
        kwargs["token_type_ids"] = inputs["segment_ids"]
        kwargs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        out = model(**kwargs)
    if headless:
        result = {"hidden_states": out.last_hidden_state.float().clone()}
    else:
        result = {k: v.float().clone() for k, v in out.items() if isinstance(v, torch.Tensor) and k.endswith("logits")}
    del model, out
    gc.collect()
    return result


def _cs_forward(model: torch.nn.Module, config: CsModelConfig, inputs: Mapping[str, torch.Tensor], headless: bool):
    with torch.no_grad():
        if config.class_name in (cfg.GPT2, cfg.GPTJ):
            if headless:
                return {"hidden_states": model.hidden_states(inputs["input_ids"])}
            return {"logits": model(inputs["input_ids"])}
        if config.class_name == cfg.T5:
            return {"logits": model(inputs["input_ids"], inputs["decoder_input_ids"])}
        segment_ids = inputs.get("segment_ids") if config.params.get("num_segments") else None
        return model(inputs["input_ids"], segment_ids)


def compare(hf: torch.Tensor, cs: torch.Tensor) -> dict[str, Any]:
    if hf.shape != cs.shape:
        return {"shape_hf": list(hf.shape), "shape_cs": list(cs.shape), "max_abs_diff": float("inf")}
    diff = (hf - cs).abs()
    scale = float(hf.abs().max()) if hf.numel() else 0.0
    max_abs = float(diff.max()) if diff.numel() else 0.0
    a, b = hf.flatten().double(), cs.flatten().double()
    denom = float(a.norm() * b.norm())
    cosine = float(a @ b) / denom if denom else (1.0 if max_abs == 0 else 0.0)
    return {
        "shape": list(hf.shape),
        "max_abs_diff": max_abs,
        "max_rel_diff": max_abs / scale if scale else max_abs,
        "cosine_similarity": cosine,
        "max_abs_hf": scale,
    }


def verify(
    hf_dir: str,
    cs_ckpt: str,
    cs_config: str | Mapping[str, Any],
    model: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    rtol: float = 0.0,
    batch_size: int = 2,
    seq_len: int = 16,
    seed: int = 0,
    strict: bool = True,
) -> dict[str, Any]:
    """Run the Hugging Face model in ``hf_dir`` and the simulator's model of ``cs_ckpt`` and compare.

    ``hf_dir``, ``cs_ckpt`` and ``cs_config`` may be local paths or ``s3://`` URIs; ``cs_config`` may
    also be an already parsed config. Returns a JSON-able dict with
    ``passed`` and ``verdict``; never raises for a numeric mismatch (only for unusable inputs).
    """
    if tolerance < 0 or rtol < 0:
        raise InvalidRequest("tolerance and rtol must be non-negative")
    if model in NOT_SIMULATED:
        return {"verdict": "skipped", "passed": False, "reason": NOT_SIMULATED[model]}
    config_doc = read_cs_yaml(cs_config) if isinstance(cs_config, str) else dict(cs_config)
    cs_cfg = parse_model_config(config_doc, model)
    hf_class, headless = hf_class_for(cs_cfg.model)
    inputs = make_inputs(cs_cfg, batch_size=batch_size, seq_len=seq_len, seed=seed)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    with local_hf_dir(hf_dir) as local_dir:
        hf_out = _hf_forward(local_dir, hf_class, headless, inputs)
    timings["hf_seconds"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    cs_model = build_model(cs_cfg, materialize="empty" if strict else "init", seed=seed)
    source = open_checkpoint(cs_ckpt)
    try:
        report = load_model_state(cs_model, source, strict=strict)
    finally:
        source.close()
    timings["cs_load_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cs_model.eval()
    cs_out = _cs_forward(cs_model, cs_cfg, inputs, headless)
    timings["cs_forward_seconds"] = time.perf_counter() - t0
    del cs_model
    gc.collect()

    if headless:
        names = {"hidden_states": "hidden_states"}
    elif hf_class == "RobertaForMaskedLM":
        names = {"mlm_logits": "logits"}  # RoBERTa has no NSP head; its MLM output is plain `logits`
    else:
        names = OUTPUT_NAMES[cs_cfg.class_name]
    outputs: dict[str, Any] = {}
    for cs_name, hf_name in names.items():
        if cs_name not in cs_out:
            continue
        if hf_name not in hf_out:
            outputs[cs_name] = {"error": f"the Hugging Face model returned no {hf_name}"}
            continue
        outputs[cs_name] = compare(hf_out[hf_name], cs_out[cs_name].float())
    passed = bool(outputs) and all(
        "max_abs_diff" in o and o["max_abs_diff"] <= tolerance + rtol * o.get("max_abs_hf", 0.0)
        for o in outputs.values()
    )
    worst = max((o.get("max_abs_diff", float("inf")) for o in outputs.values()), default=float("inf"))
    worst_rel = max((o.get("max_rel_diff", float("inf")) for o in outputs.values()), default=float("inf"))
    cosine = min((o.get("cosine_similarity", 0.0) for o in outputs.values()), default=0.0)
    return {
        "verdict": "pass" if passed else "fail",
        "passed": passed,
        "model": cs_cfg.model,
        "cs_class": cs_cfg.class_name,
        "hf_class": hf_class,
        "hf_dir": hf_dir,
        "cs_checkpoint": cs_ckpt,
        "tolerance": tolerance,
        "rtol": rtol,
        "dtype": "float32",
        "checkpoint_dtypes": report.source_dtypes,
        "inputs": {k: list(v.shape) for k, v in inputs.items()} | {"seed": seed},
        "max_abs_diff": worst,
        "max_rel_diff": worst_rel,
        "cosine_similarity": cosine,
        "outputs": outputs,
        "load": report.to_dict(),
        "ignored_config_keys": list(cs_cfg.ignored),
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }
