"""End-to-end calibration cost: wall time and peak RSS (and peak VRAM on CUDA) of `gptq` vs `tarq`.

    python -m tarq_deploy.bench.calibration [--model packaged:base] [--n 128] [--device cpu|cuda] [--out FILE.json]
    python -m tarq_deploy.bench.calibration --dims small --device cuda       # real-dimension random-weight models
    python -m tarq_deploy.bench.calibration --dims tiny,base,small --n 32,128 --type q3_k --out FILE.json   # a grid

With several --dims or --n values every combination is measured (each method in its own child), smallest first, and
the rows say how time and memory grow with the model and the calibration set: each row has the time of every stage
(model, windows, propagate, solve) and the RSS high-water mark as each ends. A cell over --max-seconds is stopped and
recorded with how far it got (the last block finished, the RSS so far); the larger calibration sets of that method at
least as large a model are then recorded as skipped, so the grid always finishes and never spends the limit twice on
what is certain to exceed it. Every model is still tried at the smallest set.

The JSON (and its table, FILE.md) is rewritten after every cell; ``--resume`` keeps the cells an earlier run of the
same grid finished (same settings, same processor kind; each row says when and by which code it ran) and measures
only the rest, so a grid of hours survives an interrupted session. A resumed run may name fewer models, sets or methods
(the cell that matters first); the file keeps the cells it does not name.

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

from tarq_deploy.values import memory_size
from tarq_deploy.errors import UserError
from tarq_deploy.quant.choices import COMPUTE_DTYPES
from tarq_deploy.models.whisper_shapes import WHISPER_DIMS

__all__ = ["DIMS", "beyond_a_stopped_cell", "cell_figures", "child_launch", "main", "resumed_rows",
           "speedups_over_baseline", "tarq_over_gptq"]

DIMS = WHISPER_DIMS  # real Whisper dimensions, random weights (no such checkpoints offline)


def cycled_corpus(n: int, directory: Path, clips_manifest: str | None = None) -> Path:
    """A JSONL manifest of n utterances cycling the real clips (jfk excluded: it is the usual test clip), or the
    utterances of ``clips_manifest`` (what --prepare-carry writes for a machine without the Debian clips)."""
    import numpy as np

    from tarq_deploy.data.corpus import Utterance, encode_wav_float32, load_audio, load_corpus, write_manifest
    from tarq_deploy.data.real_clips import all_real_clips

    clips = load_corpus(clips_manifest) if clips_manifest else \
        [Utterance(c.id, str(c.path), c.text) for c in all_real_clips() if c.id != "jfk"]
    rows = []
    for i in range(n):
        clip = clips[i % len(clips)]
        audio = np.roll(load_audio(clip), i * 592)  # 37 ms at 16 kHz
        path = directory / f"utt{i:04d}.wav"
        path.write_bytes(encode_wav_float32(audio, 16000))
        rows.append(Utterance(f"utt{i:04d}", str(path), clip.text))
    manifest = directory / "calib.jsonl"
    write_manifest(rows, manifest)
    return manifest


def random_whisper(dims: str, device: str, processor_source: str = "packaged:tiny.en", dtype: str = "float16"):
    """A real-dimension Whisper with random weights held in ``dtype`` (float16: how the hub and the packaged
    checkpoints store them) and the tokenizer of ``processor_source`` (tiny.en's: vocabulary 51864); 128 mel bins
    take large-v3's vocabulary (51866, made from base's multilingual tokenizer)."""
    import torch

    from tarq_deploy.formats.model_loader import load_whisper
    from tarq_deploy.models.whisper_shapes import random_whisper as random_shape

    if DIMS[dims]["num_mel_bins"] == 128 and processor_source == "packaged:tiny.en":
        processor_source = "packaged:base"  # large-v3's vocabulary is made from a multilingual one
    processor, generation_config = processor_only(processor_source) if Path(processor_source).is_dir() else \
        load_whisper(processor_source)[1:]
    model, processor, generation_config = random_shape(dims, processor, generation_config,
                                                       dtype=getattr(torch, dtype))
    return model.to(device), processor, generation_config


# The published models the grid and bench.peers measure at real size from a folder (random weights, as the hub
# stores them: bfloat16 for the audio LLMs, float16 for Whisper): written once by --write-random, then given as
# --model like a user's download.
RANDOM_MODELS = ("qwen3-asr-0.6B", "qwen3-asr-1.7B", "voxtral-mini-3B", *(f"whisper-{d}" for d in DIMS))


def write_random_model(shape: str, directory: Path) -> Path:
    """A transformers folder of ``shape`` (RANDOM_MODELS) with seeded random weights; an existing non-empty folder
    is refused, so a model a user cares about is never overwritten."""
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory}: exists and is not empty; --write-random writes a new folder")
    if shape.startswith("whisper-"):
        model, processor, generation_config = random_whisper(shape.removeprefix("whisper-"), "cpu",
                                                             "packaged:base")
        for part in (model, processor, generation_config):
            part.save_pretrained(directory)
        return directory
    if shape.startswith("qwen3-asr-"):
        from tarq_deploy.models.qwen3_asr_shapes import write_random_qwen3_asr

        return write_random_qwen3_asr(directory, shape.removeprefix("qwen3-asr-"))
    from tarq_deploy.models.voxtral_shapes import write_random_voxtral

    return write_random_voxtral(directory)


def processor_only(directory: str):
    """(processor, generation config) from a folder holding only those files (--prepare-carry's processor/)."""
    from transformers import GenerationConfig, WhisperProcessor

    return WhisperProcessor.from_pretrained(directory), GenerationConfig.from_pretrained(directory)


# What the lent GPU's image lacks among this project's imports (its package list: the device README's KINDS.md).
# gguf: the ggml block codecs; wcwidth: ftfy's; locate: wordfreq's. Checked by tests/test_gpu_calibration_dryrun.py,
# which hides every installed package that the image does not hold.
CARRY_PACKAGES = ("wordfreq", "ftfy", "wcwidth", "locate", "langcodes", "language_data", "jiwer", "whisper_normalizer",
                  "gguf")


def prepare_carry(directory: Path, processor_source: str = "packaged:base") -> None:
    """What a machine without this project's offline data needs for a cell (a lent GPU: no registry, no Debian
    clips, 64 MiB per call): the real clips and their manifest (clips.jsonl), a multilingual processor
    (processor/: large-v3's vocabulary is made from it) and site/, the pure-Python packages rarity tagging needs
    that such a machine lacks, with wordfreq's English tables only (its tables for other languages are 50 MB)."""
    import importlib.util
    import shutil

    from tarq_deploy.data.corpus import Utterance, write_manifest
    from tarq_deploy.data.real_clips import all_real_clips
    from tarq_deploy.formats.model_loader import load_whisper

    (directory / "clips").mkdir(parents=True, exist_ok=True)
    rows = []
    for clip in (c for c in all_real_clips() if c.id != "jfk"):
        target = directory / "clips" / f"{clip.id}.wav"
        shutil.copyfile(clip.path, target)
        rows.append(Utterance(clip.id, str(target), clip.text))
    write_manifest(rows, directory / "clips.jsonl")
    _, processor, generation_config = load_whisper(processor_source)
    processor.save_pretrained(directory / "processor")
    generation_config.save_pretrained(directory / "processor")
    for name in CARRY_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue  # not installed here: the device's own copy (or its absence) is reported by the env stage
        source = Path(spec.origin).parent
        keep_english = shutil.ignore_patterns("large_[!e]*", "large_e[!n]*", "small_[!e]*", "small_e[!n]*",
                                              "jieba*", "_chinese*", "__pycache__")
        shutil.copytree(source, directory / "site" / name, ignore=keep_english, dirs_exist_ok=True)


def child(args: argparse.Namespace) -> None:
    """One calibration in this process. Prints a STAGE line as each stage ends (its time from the start and this
    process's RSS high-water mark then), so a parent that stops it knows how far it got, and a RESULT line with the
    figures at the end."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tarq_deploy.data.corpus import load_corpus
    from tarq_deploy.formats.backbones import load_backbone
    from tarq_deploy.models.whisper import WhisperBackbone
    from tarq_deploy.quant.choices import GGML_TYPES
    from tarq_deploy.calibration.options import QuantizeOptions
    from tarq_deploy.calibration.pipeline import quantize_backbone
    from tarq_deploy.quant.precision import resolve_compute_dtype

    start = time.perf_counter()
    stages: dict[str, dict] = {}

    def milestone(name: str) -> None:
        stages[name] = {"at_s": time.perf_counter() - start, "peak_rss_mb": _peak_rss_mb()}
        print("STAGE " + json.dumps({"stage": name, **stages[name]}), flush=True)

    if args.dims:
        backbone = WhisperBackbone(*random_whisper(args.dims, args.device, args.processor, args.source_dtype),
                                   args.device)
    else:  # any model quantize takes, loaded as quantize loads it (Whisper, Qwen3-ASR, Voxtral; stored precision)
        backbone = load_backbone(args.model, args.device)
    model = backbone.model
    milestone("model")
    scheme, bits, native_group = GGML_TYPES[args.type] if args.type else ("symmetric", 4, args.group_size)
    group = args.group_size if scheme == "symmetric" else native_group
    options = QuantizeOptions(method=args.method, n_calib=args.n, device=args.device, group_size=group, bits=bits,
                              scheme=scheme, max_memory=args.max_memory,
                              compute_dtype=resolve_compute_dtype(args.compute_dtype, args.device))
    utterances = load_corpus(args.manifest)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # A work directory as `tarq-deploy quantize` has one: finished blocks live there, not in memory
    with tempfile.TemporaryDirectory(prefix="tarq-calibration-") as work:
        _, timing = quantize_backbone(backbone, utterances, options, args.model, Path(work) / "partial",
                                      log=lambda _: None, milestone=milestone)
        milestone("done")
    print("RESULT " + json.dumps(cell_figures(args, stages, timing, model)), flush=True)


def cell_figures(args: argparse.Namespace, stages: dict[str, dict], timing: dict, model) -> dict:
    """A finished cell's row: the time of each stage and the RSS high-water mark at its end (the peak so far, so a
    stage's own peak is the figure where it first rises). Stages: model (build or load), windows (audio decoding,
    features, rare-word tags and alignment of the calibration set), propagate (running the blocks over the windows,
    capturing inputs and accumulating Hessians) and solve (the per-Linear solvers, summed from the layer log)."""
    import torch

    solve = sum(layer["seconds"] or 0.0 for layer in timing["layers"])
    import tarq_deploy

    figures = {"method": args.method, "dims": args.dims or args.model, "n": args.n, "type": args.type or "",
               "package": str(Path(tarq_deploy.__file__).resolve().parent),
               "wall_s": stages["done"]["at_s"], "calibration_s": timing["seconds"],
               "stage_s": {"model": stages["model"]["at_s"],
                           "windows": stages["windows"]["at_s"] - stages["model"]["at_s"],
                           "propagate": timing["seconds"] - solve, "solve": solve},
               "peak_rss_mb_after": {stage: stages[stage]["peak_rss_mb"] for stage in ("model", "windows", "done")},
               "peak_rss_mb": stages["done"]["peak_rss_mb"], "parameters": sum(p.numel() for p in model.parameters()),
               "weights_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
               "compute_dtype": timing.get("compute_dtype", "float32"),
               "blocks": sum(1 for name in stages if name.startswith("block ")),
               # blocks whose full-precision stream the alignment pass had computed and kept (--max-memory)
               "fp_blocks_reused": timing.get("fp_blocks_reused", 0),
               # the high-water mark after each calibrated block: where in the sweep the memory peaks
               "peak_rss_mb_after_block": [round(v["peak_rss_mb"]) for k, v in stages.items() if k.startswith("block ")]}
    if args.device == "cuda":
        figures["peak_vram_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return figures


def _peak_rss_mb(status: Path = Path("/proc/self/status")) -> float:
    """A process's own high-water mark (VmHWM): ru_maxrss would include the parent's pre-exec peak."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:  # the process is gone
        pass
    return float("nan")


def child_launch(args: argparse.Namespace, method: str, manifest: Path, dims: str | None, n: int,
                 baseline: bool = False) -> tuple[list[str], dict[str, str], str | None]:
    """The command, environment and working directory of a cell's child. A baseline child runs in --baseline-code:
    ``python -m`` puts its working directory first on sys.path, so one started from this repository's root would
    import this package, whatever PYTHONPATH says, and time the current code twice (which the rows before this was
    found did; each row now names the package its child imported)."""
    model, processor = (str(Path(v).resolve()) if Path(v).exists() else v for v in (args.model, args.processor))
    cmd = [sys.executable, "-m", "tarq_deploy.bench.calibration", "--child", "--method", method,
           "--manifest", str(Path(manifest).resolve()), "--model", model, "--n", str(n), "--device", args.device,
           "--group-size", str(args.group_size), "--threads", str(args.threads or 0),
           *(["--type", args.type] if args.type else [])]
    if dims:
        cmd += ["--dims", dims, "--processor", processor, *([] if baseline else ["--source-dtype", args.source_dtype])]
    if args.max_memory is not None and not baseline:
        cmd += ["--max-memory", str(args.max_memory)]
    if not baseline:  # an older checkout has no --compute-dtype: it computes in float32
        cmd += ["--compute-dtype", args.compute_dtype]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    if not baseline:
        return cmd, env, None
    code = str(Path(args.baseline_code).resolve())
    env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")])
    return cmd, env, code


def run_child(args: argparse.Namespace, method: str, manifest: Path, dims: str | None, n: int,
              baseline: bool = False) -> dict:
    """One cell in a fresh child. A child over --max-seconds is stopped and its row says how far it got (last stage,
    RSS high-water mark read just before the stop); one that dies (out of memory, most likely) is a failed row.
    ``baseline``: the child imports the package from --baseline-code (an older checkout) instead."""
    cmd, env, cwd = child_launch(args, method, manifest, dims, n, baseline)
    load = settled_load(args.settle_seconds)
    cell = {**cell_name(args, method, dims, n), **load, **({"code": "baseline"} if baseline else {})}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=args.max_seconds)
        except subprocess.TimeoutExpired:
            peak = _peak_rss_mb(Path(f"/proc/{proc.pid}/status"))
            proc.kill()
            stdout, _ = proc.communicate()
            return {**cell, "stopped_after_s": args.max_seconds, **_progress(stdout), "peak_rss_mb_so_far": peak}
    if proc.returncode != 0:
        killed = " (killed: out of memory?)" if proc.returncode < 0 else ""
        return {**cell, "failed": f"exit {proc.returncode}{killed}", **_progress(stdout), "stderr_tail": stderr[-2000:]}
    line = next(l for l in stdout.splitlines() if l.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), **load, **({"code": "baseline"} if baseline else {})}


IDLE_LOAD = 0.5  # 1-minute load average below which the machine counts as idle (2 cores: a busy core reads ~1)


def settled_load(max_wait_s: float, poll_s: float = 5.0) -> dict:
    """Wait (up to ``max_wait_s``) for the 1-minute load average to fall below IDLE_LOAD, so a cell does not start
    in the tail of the previous one's load; the row records the load it started at and whether that was idle. A
    cell started on a loaded machine is measured all the same but never reported as idle."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= IDLE_LOAD and time.monotonic() < deadline:
        time.sleep(poll_s)
    load = os.getloadavg()
    return {"load_average_at_start": [round(v, 2) for v in load], "idle_at_start": load[0] < IDLE_LOAD}


def cell_name(args: argparse.Namespace, method: str, dims: str | None, n: int) -> dict:
    """The fields that name a grid cell, first in each of its rows whatever became of it."""
    return {"method": method, "dims": dims or args.model, "n": n, "type": args.type or ""}


def _progress(stdout: str) -> dict:
    """How far a child got: its last STAGE line (stage name and time from its start)."""
    stages = [json.loads(l[len("STAGE "):]) for l in stdout.splitlines() if l.startswith("STAGE ")]
    return {"reached": stages[-1]["stage"], "reached_at_s": stages[-1]["at_s"]} if stages else {"reached": "start"}


def beyond_a_stopped_cell(rows: list[dict], method: str, dims: str | None, n: int) -> dict | None:
    """The row of a stopped or failed cell of ``method`` no larger in both model and calibration set than (dims, n),
    if there is one: this cell costs at least as much, so the grid records it as skipped rather than spend the limit
    again on it."""
    for row in rows:
        over = "stopped_after_s" in row or "failed" in row
        if over and row["method"] == method and _model_rank(row["dims"]) <= _model_rank(dims) and row["n"] <= n:
            return row
    return None


def _model_rank(dims: str | None) -> int:
    """Place of a model in DIMS, smallest first; a --model checkpoint (the grid's only model then) ranks 0."""
    return list(DIMS).index(dims) if dims in DIMS else 0


def tarq_over_gptq(rows: list[dict]) -> list[dict]:
    """TARQ's wall time over GPTQ's for every (dims, n) where both finished (the same machine, one run apart)."""
    done = {(r["dims"], r["n"], r["method"]): r["wall_s"] for r in rows if "wall_s" in r}
    return [{"dims": dims, "n": n, "ratio": done[(dims, n, "tarq")] / wall}
            for (dims, n, method), wall in done.items() if method == "gptq" and (dims, n, "tarq") in done]


def speedups_over_baseline(rows: list[dict]) -> list[dict]:
    """The baseline code's wall time (and peak RSS) over the current code's, for every cell both finished."""
    done = {(r["dims"], r["n"], r["method"], r.get("code", "current")): r for r in rows if "wall_s" in r}
    return [{"dims": dims, "n": n, "method": method,
             "wall": done[(dims, n, method, "baseline")]["wall_s"] / row["wall_s"],
             "calibration": done[(dims, n, method, "baseline")]["calibration_s"] / row["calibration_s"],
             "peak_rss": done[(dims, n, method, "baseline")]["peak_rss_mb"] / row["peak_rss_mb"]}
            for (dims, n, method, code), row in done.items()
            if code == "current" and (dims, n, method, "baseline") in done]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="packaged:base")
    parser.add_argument("--dims", help=f"random-weight model(s) of these real dimensions, comma-separated: "
                                       f"{', '.join(DIMS)}")
    parser.add_argument("--processor", default="packaged:tiny.en",
                        help="--dims: the Whisper whose tokenizer and feature extractor the random model takes")
    parser.add_argument("--n", default="128", help="calibration utterances; comma-separated for a grid")
    parser.add_argument("--type", help="ggml type of the lattice (as quantize --type; default: symmetric 4-bit)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop a calibration after this long")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--methods", default="gptq,tarq")
    parser.add_argument("--calib", help="a calibration manifest to use instead of the cycled real clips")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads in the children (0: default)")
    parser.add_argument("--max-memory", type=memory_size, metavar="SIZE",
                        help="the current code's children: quantize's --max-memory (default: quantize's default)")
    parser.add_argument("--compute-dtype", default="float32", choices=COMPUTE_DTYPES,
                        help="the current code's children: quantize's --compute-dtype")
    parser.add_argument("--source-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                        help="--dims: the precision the random weights are stored and held in (float16, as the hub's)")
    parser.add_argument("--settle-seconds", type=float, default=120.0,
                        help="before each cell, wait up to this long for the machine's load to settle below "
                             f"{IDLE_LOAD} (the row records the load it started at)")
    parser.add_argument("-o", "--out", default="runs/bench/calibration.json",
                        help="the grid's JSON, rewritten after every cell, and its table beside it (FILE.md)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished (and stopped) cells of an earlier run in --out, measured with the same "
                             "settings on the same processor kind, and run only the rest")
    parser.add_argument("--baseline-code", metavar="DIR",
                        help="also run every cell with the package of an older checkout (e.g. a git worktree of the "
                             "commit to compare with), right after the current code's, and report the speedups")
    parser.add_argument("--clips", help="a manifest of the clips to cycle (default: the offline real clips)")
    parser.add_argument("--prepare-carry", metavar="DIR",
                        help="write what a machine without the offline data needs (clips, processor, site/) and stop")
    parser.add_argument("--write-random", nargs=2, metavar=("SHAPE", "DIR"),
                        help=f"write a whole published model with random weights to DIR (a --model for the grid "
                             f"or bench.peers) and stop; SHAPE: {', '.join(RANDOM_MODELS)}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--manifest", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare_carry:
        prepare_carry(Path(args.prepare_carry))
        print(f"wrote {args.prepare_carry}")
        return 0
    if args.write_random:
        shape, directory = args.write_random
        if shape not in RANDOM_MODELS:
            parser.error(f"--write-random: unknown shape {shape!r} (known: {', '.join(RANDOM_MODELS)})")
        try:
            print(f"wrote {write_random_model(shape, Path(directory))}")
        except FileExistsError as error:
            parser.error(f"--write-random: {error}")
        return 0
    if args.child:
        args.n = int(args.n)
        child(args)
        return 0
    if args.resume and args.baseline_code:
        parser.error("--resume: not with --baseline-code (old and new code are timed one right after the other)")
    grid_dims = args.dims.split(",") if args.dims else [None]
    unknown = [d for d in grid_dims if d is not None and d not in DIMS]
    if unknown:
        parser.error(f"--dims: unknown {', '.join(unknown)} (known: {', '.join(DIMS)})")
    try:
        grid_n = sorted(int(n) for n in args.n.split(","))
    except ValueError:
        parser.error(f"--n {args.n}: comma-separated whole numbers")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("CUDA is not available on this machine: nothing measured.")
            return 0
    settings = grid_settings(args)
    out = Path(args.out)
    try:
        kept = resumed_rows(out, settings) if args.resume else []
    except UserError as error:
        parser.error(str(error))
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(args.calib) if args.calib else cycled_corpus(max(grid_n), Path(tmp), args.clips)
        rows: list[dict] = []
        for dims in grid_dims:
            for n in grid_n:
                for method in args.methods.split(","):
                    earlier = next((r for r in kept if _cell_key(r) == (method, dims or args.model, n)), None)
                    # Every model is tried at the smallest set even after a smaller model stopped: how far it gets
                    # and its memory then are what tell a user this machine is not enough.
                    blocker = beyond_a_stopped_cell(rows, method, dims, n) if n > grid_n[0] else None
                    if earlier is not None:
                        rows.append(earlier)
                    elif blocker:
                        rows.append({**cell_name(args, method, dims, n),
                                     "skipped": f"{blocker['dims']} at {blocker['n']} was already over the limit"})
                    else:
                        # the code taken before the child starts: the checkout may change while an hour's cell runs
                        rows.append({**code_identity(), **run_child(args, method, manifest, dims, n),
                                     **measured_now()})
                    print(json.dumps(rows[-1]), flush=True)
                    if args.baseline_code and not blocker:  # the same cell by the older code, right after
                        rows.append({**run_child(args, method, manifest, dims, n, baseline=True), **measured_now()})
                        print(json.dumps(rows[-1]), flush=True)
                    # after every cell: an interrupted grid resumes
                    write_grid(out, grid_result(args, settings, with_kept(rows, kept)))
    result = grid_result(args, settings, with_kept(rows, kept))  # what the last cell wrote, for the ratio below
    if "ratio_tarq_over_gptq" in result:
        print(f"tarq/gptq end to end: {result['ratio_tarq_over_gptq']:.2f}")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def grid_settings(args: argparse.Namespace) -> dict:
    """What makes two runs' cells comparable: the same workload on the same processor kind. A grid resumed from an
    earlier run's file must match all of it (time on an Intel Xeon and time on an AMD EPYC are not one table)."""
    from tarq_deploy.machine import cpu_field, cpu_isa, cpu_model

    return {"model": args.model if not args.dims else "random weights, real dimensions", "device": args.device,
            "type": args.type or "symmetric 4-bit", "group_size": args.group_size,
            "corpus": args.calib or "cycled real clips", "threads": args.threads or "default",
            "compute_dtype": args.compute_dtype, "source_dtype": args.source_dtype, "max_memory": args.max_memory,
            "max_seconds": args.max_seconds,
            "processor": {"cpu_model": cpu_model(), "cpu_family": cpu_field("cpu family"), "cpu_isa": cpu_isa(),
                          "logical_cores": os.cpu_count()}}


def resumed_rows(out: Path, settings: dict) -> list[dict]:
    """The rows of an earlier run of this grid in ``out`` worth keeping: finished cells and cells stopped at the same
    --max-seconds; a failed, skipped or never-reached cell runs again. No file: nothing to keep. A file of another
    benchmark, settings or processor kind is refused (UserError), never mixed in."""
    if not out.exists():
        return []
    try:
        earlier = json.loads(out.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UserError(f"--resume: {out} is not a calibration grid this bench wrote ({error})") from None
    if not isinstance(earlier, dict) or earlier.get("benchmark") != "calibration" or \
            not isinstance(earlier.get("rows"), list) or not isinstance(earlier.get("settings"), dict):
        raise UserError(f"--resume: {out} is not a calibration grid this bench wrote (no settings and rows)")
    if not earlier["settings"].keys() <= settings.keys():  # names this bench never writes: not its file
        raise UserError(f"--resume: {out} is not a calibration grid this bench wrote (settings it does not know)")
    differ = sorted(k for k in settings if settings[k] != earlier["settings"].get(k))
    if differ:
        then = ", ".join(f"{key}={earlier['settings'].get(key)!r}" for key in differ)
        raise UserError(f"--resume: {out} was measured with other {', '.join(differ)} ({then}); give another --out")
    return [row for row in earlier["rows"] if isinstance(row, dict) and row.get("code") != "baseline"
            and ("wall_s" in row or "stopped_after_s" in row) and _names_a_cell(row)]


def with_kept(rows: list[dict], kept: list[dict]) -> list[dict]:
    """This run's rows so far and every kept row of the resumed file not among them: the cells it has not reached
    yet, and those it does not name (a narrower run: one model, one method, the cell that matters first), so a run
    stopped at any cell leaves the file holding all it held. Smallest model and set first; with nothing left to
    add, the rows in the order they were measured."""
    reached = {_cell_key(row) for row in rows}
    pending = [row for row in kept if _cell_key(row) not in reached]
    if not pending:
        return rows
    return sorted(rows + pending, key=lambda row: (_model_rank(row["dims"]), row["n"], row["method"]))


def _names_a_cell(row: dict) -> bool:
    method, dims, n = _cell_key(row)
    return isinstance(method, str) and isinstance(dims, str) and isinstance(n, int)


def _cell_key(row: dict) -> tuple:
    return row.get("method"), row.get("dims"), row.get("n")


def measured_now() -> dict:
    """When a cell finished (a resumed grid's rows may come from several sessions)."""
    return {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def code_identity() -> dict:
    """The current package's code hash and git commit: which code a cell ran."""
    from tarq_deploy.hashing import code_version

    return {"code_version": code_version(), "git_commit": _git_commit()}


def _git_commit() -> str | None:
    """The checkout's commit, "+changes" when the package differs from it; None outside a git checkout."""
    package = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=package, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=package, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def grid_result(args: argparse.Namespace, settings: dict, rows: list[dict]) -> dict:
    current = [r for r in rows if r.get("code") != "baseline"]
    by_method = {r["method"]: r for r in current if "wall_s" in r}
    models = (",".join(dict.fromkeys(str(r["dims"]) for r in rows)) or args.dims) if args.dims else args.model
    sets = ",".join(str(n) for n in sorted({r["n"] for r in rows})) or args.n
    result = {"benchmark": "calibration", "model": models, "device": args.device, "n": sets,
              **{key: settings[key] for key in ("type", "corpus", "threads", "group_size")}, "settings": settings,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
              "rows": rows}
    result["ratios_tarq_over_gptq"] = tarq_over_gptq(current)
    if args.baseline_code:
        result["baseline_code"] = args.baseline_code
        result["speedups_over_baseline"] = speedups_over_baseline(rows)
    if {"gptq", "tarq"} <= by_method.keys() and len(current) == 2:
        result["ratio_tarq_over_gptq"] = by_method["tarq"]["wall_s"] / by_method["gptq"]["wall_s"]
    return result


def write_grid(out: Path, result: dict) -> None:
    """The JSON and, beside it, its table (FILE.md), each written whole (never half a file)."""
    from tarq_deploy.fileio import write_json_atomic, write_text_atomic

    write_json_atomic(out, result)
    write_text_atomic(out.with_suffix(".md"), grid_markdown(result))


def grid_markdown(result: dict) -> str:
    """The cost-growth table: per cell the time of every stage, the RSS high-water mark after the windows and at the
    end, the load the cell started at and when it ran; a cell that did not finish says what became of it."""
    settings = result.get("settings", {})
    processor = settings.get("processor", {})
    lines = [f"# Calibration cost: {result['model']} ({result['device']})", "",
             f"Processor: {processor.get('cpu_model', 'unknown')} (family {processor.get('cpu_family', '?')}, "
             f"{processor.get('logical_cores', '?')} logical cores, {' '.join(processor.get('cpu_isa', []))}); "
             f"threads {result['threads']}; lattice {result['type']}, groups of {result['group_size']}; "
             f"corpus: {result['corpus']}.", "",
             "| model | utts | method | wall s | model s | windows s | propagate s | solve s | RSS after windows MiB "
             "| peak RSS MiB | load at start | finished (UTC) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in result["rows"]:
        head = f"| {row['dims']} | {row['n']} | {row['method']}{' (baseline code)' if row.get('code') else ''} |"
        load = row.get("load_average_at_start")
        started = f"{load[0]:.2f}{'' if row.get('idle_at_start') else ' (not idle)'}" if load else "—"
        when = row.get("measured_at", "—")
        if "wall_s" in row:
            stage = row["stage_s"]
            lines.append(f"{head} {row['wall_s']:.0f} | {stage['model']:.0f} | {stage['windows']:.0f} | "
                         f"{stage['propagate']:.0f} | {stage['solve']:.0f} | "
                         f"{row['peak_rss_mb_after']['windows']:,.0f} | {row['peak_rss_mb']:,.0f} | {started} | {when} |")
        else:
            what = (f"stopped at {row['stopped_after_s']:.0f} s after {row.get('reached', 'start')}"
                    if "stopped_after_s" in row else row.get("skipped") or row.get("failed", "not run"))
            lines.append(f"{head} {what} | | | | | | | {started} | {when} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
