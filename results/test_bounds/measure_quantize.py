"""Spread of the figures tests/test_quantize_whisper.py bounds, over what legitimately varies between runs.

    python results/test_bounds/measure_quantize.py [--out results/test_bounds/quantize-<cpu>.json]

Each configuration runs in a fresh process (thread count and instruction set are fixed before torch loads):
torch threads 1 and 2, calibration seeds 0 and 1, and, on an AVX-512 processor, the AVX2 kernels as well
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2). Every configuration calibrates
real Whisper tiny.en on the test's 7 calibration clips with GPTQ and TARQ (the test's defaults) and scores each
Linear's weighted loss on the test's 4 held-out clips against RTN's. Two deliberately broken solvers show what the
bounds catch: RTN's lattice passed off as GPTQ's, and GPTQ with its Hessian damped into the identity (percdamp 1e6:
error feedback without a metric).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def figures(seed: int, n_calib: int) -> dict:
    """Run inside the child: calibrate, then the test's figures for gptq, tarq and the broken solvers."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from test_quantize_whisper import HELD_OUT, held_out_second_moments, word_error_rate

    from tarq_deploy.data.corpus import Utterance, load_audio
    from tarq_deploy.data.real_clips import all_real_clips
    from tarq_deploy.models.loader import load_whisper
    from tarq_deploy.models.whisper import WhisperBackbone
    from tarq_deploy.quant.gptq import weighted_loss
    from tarq_deploy.quant.pipeline import QuantizeOptions, quantize_backbone

    every = all_real_clips()
    clips = {"calib": [Utterance(c.id, str(c.path), c.text) for c in every if c.id not in HELD_OUT],
             "held": [c for c in every if c.id in HELD_OUT]}
    H = held_out_second_moments(clips)
    jfk = next(c for c in clips["held"] if c.id == "jfk")

    def solve(**knobs):
        model, processor, gc = load_whisper("packaged:tiny.en")
        backbone = WhisperBackbone(model, processor, gc)
        options = QuantizeOptions(seed=seed, n_calib=n_calib, **knobs)
        ckpt, _ = quantize_backbone(backbone, clips["calib"], options, "packaged:tiny.en", log=lambda _: None)
        return ckpt.quantized

    model, processor, gc = load_whisper("packaged:tiny.en")
    W = {n: p.detach().float() for n, p in model.state_dict().items()}
    rtn = solve(method="rtn")
    rtn_loss = {n: weighted_loss(W[n] - q.dequantize(), H[n]) for n, q in rtn.items()}
    solved = {"gptq": solve(method="gptq"), "tarq": solve(method="tarq"), "broken: rtn as gptq": rtn,
              "broken: gptq, identity metric": solve(method="gptq", percdamp=1e6)}
    out = {}
    for label, lattice in solved.items():
        loss = {n: weighted_loss(W[n] - q.dequantize(), H[n]) for n, q in lattice.items()}
        encoder = [n for n in loss if ".encoder." in n]
        ratios = {n: loss[n] / rtn_loss[n] for n in loss}
        out[label] = {
            "encoder_win_fraction": sum(ratios[n] < 1 for n in encoder) / len(encoder),
            "win_fraction": sum(r < 1 for r in ratios.values()) / len(ratios),
            "mean_ratio": sum(ratios.values()) / len(ratios),
            "encoder_loss_ratio": sum(loss[n] for n in encoder) / sum(rtn_loss[n] for n in encoder),
            "loss_ratio": sum(loss.values()) / sum(rtn_loss.values()),
            "jfk_wer": _jfk_wer(lattice, jfk, word_error_rate, load_audio, load_whisper, WhisperBackbone),
        }
    out["rtn"] = {"jfk_wer": _jfk_wer(rtn, jfk, word_error_rate, load_audio, load_whisper, WhisperBackbone)}
    out["torch"] = {"threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability()}
    return out


def _jfk_wer(lattice, jfk, word_error_rate, load_audio, load_whisper, WhisperBackbone) -> float:
    import torch

    model, processor, gc = load_whisper("packaged:tiny.en")
    with torch.no_grad():
        for name, q in lattice.items():
            model.get_parameter(name).copy_(q.dequantize())
    text = WhisperBackbone(model, processor, gc).transcribe(load_audio(str(jfk.path)))
    return word_error_rate(jfk.text, text)


def configurations() -> list[dict]:
    """Threads 1 and 2 on every instruction set torch can run here, with the test's whole pool (7 of 7 clips: the
    seed then changes nothing, measured once); then other calibration draws, 6 of the 7 clips by seed."""
    avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    isas = ["native", "avx2"] if avx512 else ["native"]
    whole_pool = [{"threads": t, "seed": 0, "isa": isa, "n_calib": 128} for isa in isas for t in (1, 2)]
    seed_only = [{"threads": 1, "seed": 1, "isa": "native", "n_calib": 128}]
    draws = [{"threads": 2, "seed": s, "isa": "native", "n_calib": 6} for s in (0, 1, 2)]
    return whole_pool + seed_only + draws


def run_child(config: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(config["threads"]), MKL_NUM_THREADS=str(config["threads"]),
               PYTHONPATH=str(ROOT))
    if config["isa"] == "avx2":
        env.update(AVX2)
    done = subprocess.run([sys.executable, __file__, "--child", str(config["seed"]), str(config["n_calib"])], env=env,
                          capture_output=True, text=True, check=True)
    return {**config, **json.loads(done.stdout.strip().splitlines()[-1])}


def config_key(config: dict) -> tuple:
    return tuple(config.get(k, 128 if k == "n_calib" else None) for k in ("threads", "seed", "isa", "n_calib"))


def reused_runs(path: Path | None) -> dict[tuple, dict]:
    if path is None or not path.is_file():
        return {}
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {config_key(r): {"n_calib": 128, **r} for r in runs}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reuse", type=Path, help="JSON lines of configurations already measured (this script's "
                                                   "stdout): kept instead of run again")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(figures(*args.child)))
        return
    vendor = "intel" if "Intel" in cpu_model() else "amd" if "AMD" in cpu_model() else "cpu"
    out = args.out or ROOT / "results" / "test_bounds" / f"quantize-{vendor}.json"
    runs = []
    reused = reused_runs(args.reuse)
    for config in configurations():
        runs.append(reused.get(config_key(config)) or run_child(config))
        print(json.dumps(runs[-1]), flush=True)
    out.write_text(json.dumps({"cpu_model": cpu_model(), "command": "python results/test_bounds/measure_quantize.py",
                               "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
