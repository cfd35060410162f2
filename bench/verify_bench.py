"""Verify benchmark: a ~125M-parameter model converted to Cerebras and checked logit for logit.

Builds a GPT-2 small (124M parameters, float32) or a Llama-style model of about the same size
from its config with random weights (nothing is downloaded), saves it as a Hugging Face
checkpoint, converts it with ``ckptconv convert-model --tgt-fmt cs-2.9``, then runs
``ckptconv verify``. Each step is its own process, so its wall time includes interpreter and
library start-up and its peak RSS is its own; the verify stages (Hugging Face forward, Cerebras
model build + load, Cerebras forward) are taken from its JSON report.

    python -m bench.verify_bench [--model gpt2|llama] [--seq-len 128] [--workdir .bench-verify]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench.convert_bench import run_measured

# GPT-2 small, and a Llama with the same width and depth (grouped KV heads, SwiGLU).
CONFIGS: dict[str, dict[str, object]] = {
    "gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
    },
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
}


def build_hf(model: str, out: Path | str) -> int:
    """Save a randomly initialised model of ``CONFIGS[model]`` to ``out``; its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(CONFIGS[model])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf = AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in hf.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(CONFIGS), default="gpt2")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--workdir", default=".bench-verify")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = ap.parse_args(argv)

    work = Path(args.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    cli = [sys.executable, "-m", "ckptconv"]
    try:
        hf_dir = work / "hf"
        # Built in a child process: this one must stay small, since a child forked from it starts
        # with its pages and would report them as its own peak RSS.
        make = "import sys; from bench.verify_bench import build_hf; print(build_hf(*sys.argv[1:]))"
        built = subprocess.run([sys.executable, "-c", make, args.model, str(hf_dir)], check=True, capture_output=True)
        n_params = int(built.stdout.split()[-1])
        size = sum(f.stat().st_size for f in hf_dir.iterdir())
        print(f"{args.model}: {n_params / 1e6:.1f}M parameters, {size / 1e6:.0f} MB float32 safetensors")

        out = work / "cs"
        convert_cmd = [*cli, "convert-model", str(hf_dir), str(out), "--model", args.model]
        convert_cmd += ["--src-fmt", "hf", "--tgt-fmt", "cs-2.9", "--no-progress"]
        convert_s, convert_rss = run_measured(convert_cmd)
        mdl = next(out.glob("*.mdl"))
        cfg = next(out.glob("*.yaml"))
        report = work / "verify.json"
        verify_cmd = [*cli, "verify", "--hf", str(hf_dir), "--cs", str(mdl), "--cs-config", str(cfg)]
        verify_cmd += ["--model", args.model, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
        verify_s, verify_rss = run_measured([*verify_cmd, "--json"], stdout=report)
        result = json.loads(report.read_text())
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    t = result.get("timings", {})
    print(f"{'step':<34}{'wall s':>9}{'peak RSS MB':>13}")
    print(f"{'convert-model hf -> cs-2.9':<34}{convert_s:>9.2f}{convert_rss / 1e6:>13.0f}")
    print(f"{'verify (whole process)':<34}{verify_s:>9.2f}{verify_rss / 1e6:>13.0f}")
    for name in ("hf_seconds", "cs_load_seconds", "cs_forward_seconds"):
        if name in t:
            print(f"{'  ' + name.removesuffix('_seconds'):<34}{t[name]:>9.2f}")
    print(
        f"verdict {result['verdict']}: max |diff| {result['max_abs_diff']:.3g}, "
        f"max rel {result['max_rel_diff']:.3g}, cosine {result['cosine_similarity']:.6f} "
        f"(inputs {args.batch_size}x{args.seq_len})"
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
