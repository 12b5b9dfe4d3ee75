"""Per-layer solver cost: wall time of `gptq` and `tarq` on the Linear shapes of Whisper base, small and large-v3.

    python -m tarq_deploy.bench.solvers [--device cpu|cuda] [--models base,small,large-v3] [--repeats 3] [--out FILE.json]

Both solvers see the same synthetic statistics (correlated activations, 7% tail positions, a paired full-precision
stream), so the only difference is the work Algorithm 1 adds: a second sweep and one residual solve. The ratio
tarq/gptq is measured per shape in the same run (medians of ``--repeats`` runs each, interleaved). Timings cover the
solver only (metric preparation, sweeps, residual step); loss diagnostics are switched off for both.
Goal from the foundation issue: tarq <= 2.2x gptq per layer.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from tarq_deploy.fileio import write_json_atomic
from tarq_deploy.quant.lattice import LatticeSpec
from tarq_deploy.quant.stats import LayerStats
from tarq_deploy.quant.layer_solve import solve_layer
from tarq_deploy.quant.tarq import TarqConfig

# (out_features, in_features) of the distinct Linear shapes in each model's blocks.
WHISPER_SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "base": {"attn": (512, 512), "fc1": (2048, 512), "fc2": (512, 2048)},
    "small": {"attn": (768, 768), "fc1": (3072, 768), "fc2": (768, 3072)},
    "large-v3": {"attn": (1280, 1280), "fc1": (5120, 1280), "fc2": (1280, 5120)},
}
TOKENS = 4096
TAIL_SHARE = 0.07


def synthetic_stats(n: int, device: torch.device, seed: int = 0) -> LayerStats:
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(n, n, generator=g) / n**0.5
    x_q = (torch.randn(TOKENS, n, generator=g) * torch.logspace(0, -2, n)) @ mixing
    x_fp = x_q + 0.02 * torch.randn(TOKENS, n, generator=g)
    stats = LayerStats(n, device=device)
    stats.add(x_q, torch.rand(TOKENS, generator=g) < TAIL_SHARE, x_fp)
    return stats


def time_solver(W: torch.Tensor, stats: LayerStats, method: str, spec: LatticeSpec) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): on a shared machine the CPU time is the steadier figure."""
    config = TarqConfig(method=method, record_losses=False)
    if W.device.type == "cuda":
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    solve_layer("bench", W, stats, spec, config)
    if W.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - start_cpu


def bench_shape(shape: tuple[int, int], device: torch.device, repeats: int, spec: LatticeSpec) -> dict:
    m, n = shape
    stats = synthetic_stats(n, device)
    W = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(device)
    time_solver(W, stats, "gptq", spec)  # warm-up: kernels, allocator, thread pools
    wall: dict[str, list[float]] = {"gptq": [], "tarq": []}
    cpu: dict[str, list[float]] = {"gptq": [], "tarq": []}
    for _ in range(repeats):
        for method in wall:
            w, c = time_solver(W, stats, method, spec)
            wall[method].append(w)
            cpu[method].append(c)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {"shape": [m, n], "seconds": wall, "cpu_seconds": cpu, "median_gptq_s": med["gptq"],
            "median_tarq_s": med["tarq"], "ratio_tarq_over_gptq": med["tarq"] / med["gptq"],
            "median_gptq_cpu_s": med_cpu["gptq"], "median_tarq_cpu_s": med_cpu["tarq"],
            "cpu_ratio_tarq_over_gptq": med_cpu["tarq"] / med_cpu["gptq"]}


def machine(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": str(device), "cpus": os.cpu_count(),
            "load_average": os.getloadavg()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="base,small,large-v3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 gives steady figures on a shared machine: "
                                                     "barrier-heavy factorizations stall when a worker is descheduled)")
    parser.add_argument("-o", "--out", default="runs/bench/solvers.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available on this machine: nothing measured.")
        return 0
    device = torch.device(args.device)
    spec = LatticeSpec(4, args.group_size)
    rows = []
    for model in args.models.split(","):
        for layer, shape in WHISPER_SHAPES[model].items():
            row = {"model": model, "layer": layer, **bench_shape(shape, device, args.repeats, spec)}
            rows.append(row)
            print(f"{model:9s} {layer:5s} {shape[0]:5d}x{shape[1]:<5d} gptq {row['median_gptq_s']:7.3f}s  "
                  f"tarq {row['median_tarq_s']:7.3f}s  ratio {row['ratio_tarq_over_gptq']:.2f}  "
                  f"(CPU time ratio {row['cpu_ratio_tarq_over_gptq']:.2f})", flush=True)
    result = {"benchmark": "solvers", "machine": machine(device), "group_size": args.group_size,
              "repeats": args.repeats, "tokens": TOKENS, "rows": rows,
              "max_ratio": max(r["ratio_tarq_over_gptq"] for r in rows),
              "max_cpu_ratio": max(r["cpu_ratio_tarq_over_gptq"] for r in rows)}
    out = write_json_atomic(args.out, result)
    print(f"max tarq/gptq ratio {result['max_ratio']:.2f} (CPU time {result['max_cpu_ratio']:.2f}); wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
