"""End-to-end calibration cost: wall time and peak RSS (and peak VRAM on CUDA) of `gptq` vs `tarq`.

    python -m tarq_deploy.bench.calibration [--model packaged:base] [--n 128] [--device cpu|cuda] [--out FILE.json]
    python -m tarq_deploy.bench.calibration --dims small --device cuda       # real-dimension random-weight models

Each method runs in a fresh child process (peak RSS of that child from its own VmHWM, so the two do not share a high-water
mark), on the same calibration set. 128 utterances: offline there are only a dozen real transcribed clips, so the set
cycles them (utterance i = clip i mod 11, its audio shifted by i * 37 ms so no two windows are identical) — a timing
workload with real speech and real transcripts, not a quality corpus. Goals (Whisper issue): tarq <= 1.3x gptq end to
end; tarq on base <= 5 minutes on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIMS = {  # real Whisper dimensions, random weights (no such checkpoints offline)
    "small": dict(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, num_mel_bins=80),
    "large-v3": dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                     decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128),
}


def cycled_corpus(n: int, directory: Path) -> Path:
    """A JSONL manifest of n utterances cycling the real clips (jfk excluded: it is the usual test clip)."""
    import numpy as np

    from tarq_deploy.data.corpus import Utterance, encode_wav_float32, load_audio, write_manifest
    from tarq_deploy.data.real_clips import all_real_clips

    clips = [c for c in all_real_clips() if c.id != "jfk"]
    rows = []
    for i in range(n):
        clip = clips[i % len(clips)]
        audio = np.roll(load_audio(str(clip.path)), i * 592)  # 37 ms at 16 kHz
        path = directory / f"utt{i:04d}.wav"
        path.write_bytes(encode_wav_float32(audio, 16000))
        rows.append(Utterance(f"utt{i:04d}", str(path), clip.text))
    manifest = directory / "calib.jsonl"
    write_manifest(rows, manifest)
    return manifest


def random_whisper(dims: str, device: str, processor_source: str = "packaged:tiny.en"):
    """A real-dimension Whisper with random weights and the tokenizer of ``processor_source`` (tiny.en's: vocabulary
    51864)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperProcessor

    from tarq_deploy.models.loader import load_whisper

    _, processor, generation_config = load_whisper(processor_source)
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51864, **DIMS[dims])
    model = WhisperForConditionalGeneration(config)
    features = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    processor = WhisperProcessor(feature_extractor=features, tokenizer=processor.tokenizer)
    generation_config.alignment_heads = [[config.decoder_layers - 1, 0]]
    return model, processor, generation_config


def child(args: argparse.Namespace) -> None:
    """One calibration in this process; prints a JSON line with its figures."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tarq_deploy.data.corpus import load_corpus
    from tarq_deploy.models.loader import load_whisper
    from tarq_deploy.models.whisper import WhisperBackbone
    from tarq_deploy.quant.pipeline import QuantizeOptions, quantize_backbone

    model, processor, gc = (random_whisper(args.dims, args.device, args.processor) if args.dims
                            else load_whisper(args.model))
    backbone = WhisperBackbone(model, processor, gc, args.device)
    options = QuantizeOptions(method=args.method, n_calib=args.n, device=args.device, group_size=args.group_size)
    utterances = load_corpus(args.manifest)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    _, timing = quantize_backbone(backbone, utterances, options, args.model, log=lambda _: None)
    figures = {"method": args.method, "wall_s": time.perf_counter() - start, "calibration_s": timing["seconds"],
               "peak_rss_mb": _peak_rss_mb()}
    if args.device == "cuda":
        figures["peak_vram_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(figures), flush=True)


def _peak_rss_mb() -> float:
    """This process's own high-water mark (VmHWM): ru_maxrss would include the parent's pre-exec peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_child(args: argparse.Namespace, method: str, manifest: Path) -> dict:
    cmd = [sys.executable, "-m", "tarq_deploy.bench.calibration", "--child", "--method", method, "--manifest", str(manifest),
           "--model", args.model, "--n", str(args.n), "--device", args.device, "--group-size", str(args.group_size),
           "--threads", str(args.threads or 0)]
    if args.dims:
        cmd += ["--dims", args.dims, "--processor", args.processor]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{method} calibration failed:\n{done.stderr[-3000:]}")
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="packaged:base")
    parser.add_argument("--dims", choices=sorted(DIMS), help="random-weight model of these real dimensions")
    parser.add_argument("--processor", default="packaged:tiny.en",
                        help="--dims: the Whisper whose tokenizer and feature extractor the random model takes")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--methods", default="gptq,tarq")
    parser.add_argument("--calib", help="a calibration manifest to use instead of the cycled real clips")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads in the children (0: default)")
    parser.add_argument("--out", default="bench/results/calibration.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--manifest", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("CUDA is not available on this machine: nothing measured.")
            return 0
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(args.calib) if args.calib else cycled_corpus(args.n, Path(tmp))
        rows = []
        for method in args.methods.split(","):
            rows.append(run_child(args, method, manifest))
            print(json.dumps(rows[-1]), flush=True)
    by_method = {r["method"]: r for r in rows}
    result = {"benchmark": "calibration", "model": args.dims or args.model, "device": args.device, "n": args.n,
              "corpus": args.calib or "cycled real clips", "threads": args.threads or "default",
              "group_size": args.group_size, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                          "load_average": os.getloadavg()},
              "rows": rows}
    if {"gptq", "tarq"} <= by_method.keys():
        result["ratio_tarq_over_gptq"] = by_method["tarq"]["wall_s"] / by_method["gptq"]["wall_s"]
        print(f"tarq/gptq end to end: {result['ratio_tarq_over_gptq']:.2f}")
    from tarq_deploy.fileio import write_json_atomic

    out = write_json_atomic(args.out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
