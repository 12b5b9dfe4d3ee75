"""Spread of tests/test_low_bit_types.py's solver loss ratios over the synthetic problem's draw (5 seeds), torch
threads 1 and 2 and, on AVX-512 processors, torch forced to AVX2.

    python results/test_bounds/measure_low_bit.py > results/test_bounds/low_bit-<cpu>.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_quantize import AVX2, ROOT, cpu_model  # noqa: E402

SEEDS = range(5)


def child() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import test_low_bit_types as tl

    from tarq_deploy.quant.ggml_quants import ggml_quantize
    from tarq_deploy.quant.gptq import gptq_quantize
    from tarq_deploy.quant.lattice_fit import quantize_rtn
    from tarq_deploy.quant.stats import LayerStats
    from tarq_deploy.quant.tarq import TarqConfig, quantize_weight, rarebal_metric

    out = {}
    for t in tl.LOW_BIT:
        spec = tl.spec_for_type(t)
        for seed in SEEDS:
            W, H, tail = tl._weights(10 + int(t) + 100 * seed), tl._metric(11 + 100 * seed), tl._metric(12 + 100 * seed) * 0.05
            stats = tl.LayerStats(tl.N)
            stats.H_common, stats.H_tail, stats.H_delta, stats.H_delta_tail = H, tail, 0.0 * H, 0.0 * H
            stats.n_common, stats.n_tail, stats.n_delta = 2000, 100, 2100
            q_tarq, _ = quantize_weight(W, stats, spec, TarqConfig(method="tarq"))
            H_rB, _ = rarebal_metric(H, tail, 1.0)
            q_gptq = gptq_quantize(W, H, spec, scale_rule="search", act_order=True)
            for name, q, metric in (("tarq", q_tarq, H_rB), ("gptq", q_gptq, H)):
                loss = tl._loss(W, q, metric)
                out[f"{t.name}/{name}/seed{seed}"] = {
                    "vs_rtn": loss / tl._loss(W, quantize_rtn(W, spec), metric),
                    "vs_ggml": loss / tl._loss(W, ggml_quantize(W, None, spec), metric),
                    "vs_imatrix": loss / tl._loss(W, ggml_quantize(W, torch.diag(metric) / len(metric), spec), metric)}
    return out


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(child()))
        return
    avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    runs = []
    for isa in (["native", "avx2"] if avx512 else ["native"]):
        for threads in (1, 2):
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT), **(AVX2 if isa == "avx2" else {}))
            done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                  check=True)
            runs.append({"isa": isa, "threads": threads, "ratios": json.loads(done.stdout.splitlines()[-1])})
    print(json.dumps({"cpu_model": cpu_model(), "command": "python results/test_bounds/measure_low_bit.py",
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
