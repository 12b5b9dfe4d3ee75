"""Where a decoded token's GPU time goes: torch.profiler over eager decode steps of tarq_deploy.bench.gpu_decode's
static-cache loop (Voxtral-Mini-3B language model, real dimensions, random weights on the int4 g128 lattice).

    python bench/gpu_decode_profile.py --variant triton --fuse --glue compiled --out OUT.json

Eager steps (a CUDA graph replays the same kernels without the launch gaps): the GPU time of every kernel, summed
per kernel name and divided by the steps, sorted; kernels grouped into Linear / attention / glue / other by name.
Without CUDA: prints the reason and exits 0.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tarq_deploy.bench import gpu_decode as gd  # noqa: E402


def kind_of(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("attention", "fmha", "flash", "sdpa", "softmax")):
        return "attention"
    if any(k in lowered for k in ("w4a16", "sum_splits", "int4pack", "gemv", "gemm", "cutlass", "nvjet", "splitk")):
        return "linear"
    if lowered.startswith("triton_") or "elementwise" in lowered or "reduce" in lowered:
        return "glue"
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="triton", choices=gd.VARIANTS)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--context", type=int, default=383)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fuse", action="store_true")
    parser.add_argument("--glue", choices=("eager", "compiled"), default="compiled")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("CUDA not available: nothing measured")
        return 0
    from tarq_deploy.bench.gpu_voxtral import snap_layers
    from tarq_deploy.quant.lattice import LatticeSpec

    model = gd.build_text_model(gd.text_config(args.layers), 0)
    lattice = snap_layers(model.model.layers, "model.layers", LatticeSpec(4, 128, scale_grid="bfloat16"))
    if args.variant != "fp16":
        gd.swap_kernel(model, lattice, args.variant)
    fused = gd.fused_linears(model, lattice, args.variant) if args.fuse else None
    glue = gd.Glue.compiled() if args.glue == "compiled" else gd.Glue.eager()
    dec = gd.StaticDecoder(model, 64 * math.ceil((args.context + args.steps + 16) / 64), fused, glue)
    if args.variant == "triton":
        gd.tune_triton(model, fused)
    context = torch.randint(1000, 131072, (1, args.context), generator=torch.Generator().manual_seed(0)).cuda()
    dec.prefill(context)
    for _ in range(3):
        dec.step()  # warm-up: compiles
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            dec.step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us:
            rows.append({"kernel": event.key[:120], "kind": kind_of(event.key), "calls_per_step": event.count / args.steps,
                         "us_per_step": us / args.steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    kinds: dict[str, dict] = {}
    for r in rows:
        k = kinds.setdefault(r["kind"], {"us_per_step": 0.0, "kernels_per_step": 0.0})
        k["us_per_step"] += r["us_per_step"]
        k["kernels_per_step"] += r["calls_per_step"]
    result = {"config": {k: str(v) for k, v in vars(args).items()}, "kinds": kinds, "kernels": rows[:60],
              "gpu": torch.cuda.get_device_name()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["us_per_step"]):
        print(f"{name:10s} {k['us_per_step'] / 1e3:7.3f} ms/token in {k['kernels_per_step']:6.0f} kernels")
    for r in rows[:25]:
        print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:6.0f}x  {r['kind']:9s} {r['kernel'][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
