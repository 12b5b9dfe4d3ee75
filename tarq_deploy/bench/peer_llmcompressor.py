"""llm-compressor's one-shot GPTQ (or AWQ) on a Whisper model, run in the peers' own virtual environment.

This file is executed as a script by ``bench/peers.py`` with the Python of the environment llm-compressor lives in
(it pins compressed-tensors and transformers to other versions than ours, so it cannot share our environment). It
therefore imports nothing from tarq_deploy: its inputs are files, its outputs are files.

Inputs: a transformers Whisper directory (the float model our loader produced) and a safetensors file of calibration
windows (``input_features.I`` [1, mels, frames] and ``decoder_input_ids.I`` [1, T]: the very windows our own
calibration reads, so both solvers see the same audio and transcripts). Output: ``dequantized.safetensors`` with the
lattice weight of every Linear llm-compressor quantized (its fake-quantized values, as a GPU kernel would compute
them) and ``info.json`` (the layers, the scheme, the largest number of distinct values in a group).

llm-compressor's default sequential pipeline stops on Whisper ("No statistics available"); its ``basic`` pipeline runs
the whole model on every sample and calibrates all Linears at once (FACTS.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def windows_dataset(path: Path):
    """The calibration windows as a datasets.Dataset, one row per window, in file order."""
    from datasets import Dataset
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    count = len([k for k in tensors if k.startswith("input_features.")])
    rows = [{"input_features": tensors[f"input_features.{i}"][0].tolist(),
             "decoder_input_ids": tensors[f"decoder_input_ids.{i}"][0].tolist()} for i in range(count)]
    return Dataset.from_list(rows)


def one_window(batch: list[dict]) -> dict:
    """batch_size 1: the window as tensors with a batch axis (the windows differ in length)."""
    import torch

    row = batch[0]
    return {"input_features": torch.tensor(row["input_features"], dtype=torch.float32)[None],
            "decoder_input_ids": torch.tensor(row["decoder_input_ids"], dtype=torch.long)[None]}


def recipe(modifier: str, group_size: int):
    """W4A16: symmetric int4 weights, one scale per group of ``group_size`` inputs, every Linear (the tied head too)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    if modifier == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return GPTQModifier(config_groups={"group_0": scheme})
    from llmcompressor.modifiers.awq import AWQModifier

    return AWQModifier(config_groups={"group_0": scheme})


def dequantized_weights(model) -> tuple[dict, dict]:
    """Every quantized Linear's fake-quantized weight, and the most distinct values any of its groups holds."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    weights, distinct = {}, {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if not isinstance(module, torch.nn.Linear) or scheme is None or not hasattr(module, "weight_scale"):
            continue
        zero = getattr(module, "weight_zero_point", None)
        with torch.no_grad():
            value = fake_quantize(module.weight, module.weight_scale, zero, scheme.weights).float().contiguous()
        weights[f"{name}.weight"] = value
        group = scheme.weights.group_size
        groups = value.reshape(value.shape[0], -1, group)
        distinct[name] = max(len(torch.unique(groups[r, g])) for r in range(0, groups.shape[0], 97)
                             for g in range(groups.shape[1]))  # a sample of rows: the check, not a census
    return weights, distinct


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="transformers Whisper directory (float)")
    p.add_argument("--windows", required=True, help="safetensors file of calibration windows")
    p.add_argument("--modifier", choices=("gptq", "awq"), default="gptq")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--out", required=True, help="directory for dequantized.safetensors and info.json")
    args = p.parse_args(argv)

    import torch
    from llmcompressor import oneshot
    from safetensors.torch import save_file
    from transformers import WhisperForConditionalGeneration

    torch.manual_seed(0)
    model = WhisperForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32)
    dataset = windows_dataset(Path(args.windows))
    started = time.monotonic()
    oneshot(model=model, dataset=dataset, recipe=recipe(args.modifier, args.group_size), pipeline="basic",
            data_collator=one_window, batch_size=1, num_calibration_samples=len(dataset),
            shuffle_calibration_samples=False)
    seconds = time.monotonic() - started
    weights, distinct = dequantized_weights(model)
    if not weights:
        print("llm-compressor quantized no Linear", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "dequantized.safetensors.tmp"))
    (out / "dequantized.safetensors.tmp").rename(out / "dequantized.safetensors")
    import llmcompressor

    info = {"modifier": args.modifier, "scheme": "W4A16", "group_size": args.group_size, "pipeline": "basic",
            "windows": len(dataset), "layers": len(weights), "oneshot_seconds": round(seconds, 1),
            "max_distinct_values_per_group": max(distinct.values()), "llmcompressor": llmcompressor.__version__,
            "torch": torch.__version__}
    (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
