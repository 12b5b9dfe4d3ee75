"""The peer a GPU user would pick, side by side with ours: llm-compressor's GPTQ (and AWQ, where it runs) against our
RTN, GPTQ and TARQ at the paper's W4G128, on the same model, the same calibration windows and the same layers.

    python -m tarq_deploy.bench.peers --model packaged:base --calib corpora/synth/calib.jsonl --n-calib 128 \\
        --data test=corpora/synth/test.jsonl --out bench/results/peers

1. Our float model is written as a transformers directory (the reference, and llm-compressor's input), and the
   calibration windows our own quantize builds from ``--calib`` / ``--n-calib`` / ``--seed`` (input features and the
   reference transcripts as decoder inputs) are written to a safetensors file.
2. Each method calibrates in a child process, timed by its wall clock and peak RSS (os.wait4): ours through
   ``tarq-deploy quantize --target gptq`` (symmetric int4, groups of 128, every Linear including the tied head),
   llm-compressor through ``peer_llmcompressor.py`` in its own environment (``--peer-python``; make peers-venv),
   whose fake-quantized weights go back into a copy of the float model. With ``--repeats N`` every method calibrates
   N times, round by round (so that a slow minute of the machine falls on every method alike); the table gives the
   medians and ranges of the rounds, the ratios of our medians to llm-compressor's, and whether each method wrote
   the same bytes in every round. The first round's results are the ones scored.
3. ``tarq-deploy eval`` scores every model in PyTorch on the held-out ``--data``: decoded WER / rare-WER (raw and
   capped, loops) and teacher-forced KLD against the float model, with paired bootstrap intervals.

Writes OUT/peers-MODEL.json and .md (the table, the paired differences, the machine, the command). A failed peer
(AWQ has no mapping for Whisper, say) is a row with its error, not a stopped bench.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UserError
from ..fileio import write_text_atomic
from ..hashing import file_sha256
from ..machine import machine_record
from ..model_source import SourceKind, resolve_source
from ..quant.choices import COMPUTE_DTYPES

__all__ = ["Calibration", "differences", "over_rounds", "render", "summary"]

OURS = ("rtn", "gptq", "tarq")
PEERS = ("llmcompressor-gptq", "llmcompressor-awq")
REFERENCE = "FP32"
DEFAULT_GROUP_SIZE = 128  # the paper's W4G128; 32 is the Q4_0 lattice (--group-size)
DEFAULT_PEER_PYTHON = ".venv-peers/bin/python"


@dataclass(frozen=True)
class Calibration:
    """A method's calibration run: what it produced and what it cost."""

    method: str
    output: Path | None
    seconds: float  # the child process's wall clock: imports, model load, calibration, save
    peak_rss_mib: float
    error: str = ""
    # the calibration proper, as the method's own clock has it: ours, building the windows (with TARQ's alignment
    # pass) plus the sequential calibration; a peer's, its one-shot call (forward passes and solves). Without the
    # imports, the model load and the save, which differ between the environments more than the methods.
    stage_seconds: float | None = None
    # with --repeats: every round's clocks (the figures above are then their medians) and whether every round wrote
    # the same result bytes
    rounds: list[dict] = field(default_factory=list)
    same_result: bool | None = None


def timed_child(argv: list[str], log: Path) -> tuple[int, float, float]:
    """Run ``argv`` with its output in ``log``; (exit status, wall seconds, peak RSS MiB) of that child alone."""
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped above: Popen must not wait again
    return process.returncode, time.monotonic() - started, usage.ru_maxrss / 1024


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text("utf-8", "replace").replace("\r", "\n").splitlines()
             if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1][:400]


# ---------------------------------------------------------------------------------------------- inputs
def write_float_model_and_windows(source: str, calib: Path, n_calib: int, seed: int, work: Path) -> Path:
    """The float model as a transformers directory (work/float) and our calibration windows (work/windows.safetensors)."""
    import torch
    from safetensors.torch import save_file

    from ..data.corpus import load_corpus
    from ..formats.backbones import load_backbone
    from ..calibration.options import QuantizeOptions
    from ..calibration.pipeline import decode_utterances, select_calibration

    backbone = load_backbone(source)
    float_dir = work / "float"
    if resolve_source(float_dir).kind is not SourceKind.TRANSFORMERS:  # saved by an earlier run: reused
        staging = work / "float.partial"
        backbone.model.save_pretrained(staging)
        backbone.processor.save_pretrained(staging)
        backbone.generation_config.save_pretrained(staging)
        staging.rename(float_dir)
    options = QuantizeOptions(method="gptq", n_calib=n_calib, seed=seed)  # the windows, whatever the lattice
    chosen = select_calibration(load_corpus(calib), options)
    windows = backbone.build_windows(decode_utterances(chosen), options.zipf_threshold, options.pack,
                                     options.frame_tagging())
    tensors = {}
    for i, window in enumerate(windows):
        tensors[f"input_features.{i}"] = window.inputs["input_features"].to(torch.float32).contiguous()
        tensors[f"decoder_input_ids.{i}"] = window.inputs["decoder_input_ids"].to(torch.int64).contiguous()
    save_file(tensors, str(work / "windows.safetensors"))
    return float_dir


# ------------------------------------------------------------------------------------------- calibrations
def calibrate_ours(method: str, source: str, calib: Path, n_calib: int, seed: int, work: Path,
                   compute_dtype: str = "float32", group_size: int = DEFAULT_GROUP_SIZE) -> Calibration:
    out = work / f"ours-{method}"
    data = [] if method == "rtn" else ["--calib", str(calib), "--n-calib", str(n_calib)]
    argv = [sys.executable, "-m", "tarq_deploy.cli", "quantize", "--model", source, "--method", method, "--target",
            "gptq", "--group-size", str(group_size), *data, "--seed", str(seed), "--compute-dtype", compute_dtype,
            "--out", str(out)]
    if resolve_source(out).kind is SourceKind.CHECKPOINT:  # finished by an earlier run
        return _recorded(method, out)
    status, seconds, rss = timed_child(argv, work / f"ours-{method}.log")
    return _finish(method, out, status, seconds, rss, work / f"ours-{method}.log", _our_stage_seconds(out))


def calibrate_peer(peer: str, float_dir: Path, windows: Path, peer_python: str, work: Path,
                   group_size: int = DEFAULT_GROUP_SIZE) -> Calibration:
    out = work / peer
    if resolve_source(out / "model").kind is SourceKind.TRANSFORMERS:  # finished by an earlier run
        return _recorded(peer, out / "model")
    script = Path(__file__).with_name("peer_llmcompressor.py")
    argv = [peer_python, str(script), "--model", str(float_dir), "--windows", str(windows),
            "--modifier", peer.split("-", 1)[1], "--group-size", str(group_size), "--out", str(out / "raw")]
    out.mkdir(parents=True, exist_ok=True)
    status, seconds, rss = timed_child(argv, work / f"{peer}.log")
    if status == 0:
        _float_model_with(float_dir, out / "raw" / "dequantized.safetensors", out / "model")
    return _finish(peer, out / "model", status, seconds, rss, work / f"{peer}.log", _peer_stage_seconds(out / "raw"))


def _our_stage_seconds(out: Path) -> float | None:
    """Windows plus calibration from the timing log quantize writes beside its output (OUT.log.json)."""
    log = out.parent / f"{out.name}.log.json"
    try:
        timing = json.loads(log.read_text())
        return round(float(timing["seconds"]) + float(timing.get("windows_seconds", 0.0)), 1)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a run that failed before writing its log, or a log of another form


def _peer_stage_seconds(raw: Path) -> float | None:
    """The one-shot call's seconds that peer_llmcompressor.py writes into info.json."""
    try:
        return float(json.loads((raw / "info.json").read_text())["oneshot_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _float_model_with(float_dir: Path, weights: Path, out: Path) -> None:
    """A copy of the float model whose quantized Linears hold the peer's lattice weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(float_dir, dtype=torch.float32)
    state = model.state_dict()
    for name, value in load_file(str(weights)).items():
        if name not in state or state[name].shape != value.shape:
            raise UserError(f"{weights}: {name} is not a weight of the float model with shape {tuple(value.shape)}")
        with torch.no_grad():
            state[name].copy_(value)
    staging = out.with_name(out.name + ".partial")
    model.save_pretrained(staging)
    WhisperProcessor.from_pretrained(float_dir).save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    staging.rename(out)


def _finish(method: str, out: Path, status: int, seconds: float, rss: float, log: Path,
            stage_seconds: float | None = None) -> Calibration:
    if status != 0:
        return Calibration(method, None, round(seconds, 1), round(rss), f"exit {status}: {last_line(log)}")
    cost = {"seconds": round(seconds, 1), "peak_rss_mib": round(rss), "stage_seconds": stage_seconds}
    write_text_atomic(out.parent / f"{out.name}.cost.json", json.dumps(cost) + "\n")
    return Calibration(method, out, cost["seconds"], cost["peak_rss_mib"], stage_seconds=stage_seconds)


def _recorded(method: str, out: Path) -> Calibration:
    """A calibration finished by an earlier run of this bench: its output and recorded cost."""
    cost = json.loads((out.parent / f"{out.name}.cost.json").read_text())
    return Calibration(method, out, cost["seconds"], cost["peak_rss_mib"], stage_seconds=cost.get("stage_seconds"))


def over_rounds(rounds: list[list[Calibration]]) -> list[Calibration]:
    """Each method's first calibration (the one that is scored) with the medians of its rounds' clocks and peak RSS,
    every round's figures, and whether the rounds wrote the same bytes (ours: lattice.safetensors; a peer's: its
    dequantized weights). One round: the calibrations as they are."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for attempts in zip(*rounds):
        first, done = attempts[0], [c for c in attempts if not c.error]
        if first.error:
            merged.append(first)
            continue
        stages = [c.stage_seconds for c in done if c.stage_seconds is not None]
        digests = {_result_digest(c) for c in done}
        merged.append(replace(
            first, seconds=round(statistics.median(c.seconds for c in done), 1),
            peak_rss_mib=round(statistics.median(c.peak_rss_mib for c in done)),
            stage_seconds=round(statistics.median(stages), 1) if stages else None,
            rounds=[{"seconds": c.seconds, "stage_seconds": c.stage_seconds, "peak_rss_mib": c.peak_rss_mib,
                     "error": c.error} for c in attempts],
            same_result=None if None in digests else len(digests) == 1))
    return merged


def _result_digest(run: Calibration) -> str | None:
    """sha256 of what a calibration wrote: our lattice, or the peer's dequantized weights."""
    path = run.output / "lattice.safetensors" if run.method in OURS else \
        run.output.parent / "raw" / "dequantized.safetensors"
    return file_sha256(path) if path.is_file() else None


# ------------------------------------------------------------------------------------------------ scoring
def evaluate(float_dir: Path, runs: list[Calibration], data: list[str], limit: int | None, threads: int,
             resamples: int, out: Path, teacher_forced_only: bool = False) -> dict:
    """``tarq-deploy eval`` of every calibrated model against the float one; ``teacher_forced_only``: KLD and the
    other teacher-forced figures without decoding (minutes instead of an hour on base)."""
    models = [arg for run in runs if run.output for arg in ("--model", f"{run.method}={run.output}")]
    present = {run.method for run in runs if run.output}
    pairs = [(a, b) for a, b in (("tarq", "gptq"), ("gptq", "llmcompressor-gptq"), ("tarq", "llmcompressor-gptq"),
                                 ("gptq", "rtn"), ("tarq", "rtn"), ("llmcompressor-gptq", "rtn"),
                                 ("llmcompressor-awq", "llmcompressor-gptq")) if a in present and b in present]
    argv = [sys.executable, "-m", "tarq_deploy.cli", "eval", *(a for d in data for a in ("--data", d)),
            "--backend", "torch", "--model", f"{REFERENCE}={float_dir}", *models, "--reference", REFERENCE,
            "--teacher-forced", *(a for p in pairs for a in ("--compare", f"{p[0]}:{p[1]}")),
            "--threads", str(threads), "--resamples", str(resamples), "--out", str(out / "eval"), "--quiet",
            *(["--limit", str(limit)] if limit else []), *(["--teacher-forced-only"] if teacher_forced_only else [])]
    status, _, _ = timed_child(argv, out / "eval.log")
    if status != 0:
        raise UserError(f"tarq-deploy eval failed: {last_line(out / 'eval.log')}")
    return json.loads((out / "eval" / "report.json").read_text())


# ------------------------------------------------------------------------------------------------ report
def summary(runs: list[Calibration], report: dict) -> list[dict]:
    """One row per method and dataset: cost, decoded and teacher-forced figures."""
    rows = []
    for dataset in report["datasets"]:
        decoded = {m["label"]: m for m in dataset.get("models", [])}  # none with --teacher-forced-only
        figures = {m["label"]: m for m in dataset.get("teacher_forced", {}).get("models", [])}
        for run in runs:
            row = {"dataset": dataset["name"], "method": run.method, "seconds": run.seconds,
                   "stage_seconds": run.stage_seconds, "peak_rss_mib": run.peak_rss_mib, "error": run.error,
                   **({"rounds": run.rounds, "same_result": run.same_result} if run.rounds else {})}
            if run.method in decoded:
                d = decoded[run.method]
                row.update({k: d[k] for k in ("wer", "rare_wer", "capped_wer", "capped_rare_wer")}, loops=d["loops"])
            if run.method in figures:
                row.update({k: figures[run.method][k] for k in ("kld_rare", "kld_common")})
            rows.append(row)
    return rows


def _cell(value: dict | None, scale: float = 100.0, digits: int = 1) -> str:
    if not value:
        return "—"
    star = " *" if value.get("significant") else ""
    fmt = f"{{:+.{digits}f}}" if "significant" in value else f"{{:.{digits}f}}"
    return f"{fmt.format(scale * value['value'])} [{fmt.format(scale * value['low'])}, " \
           f"{fmt.format(scale * value['high'])}]{star}"


def render(result: dict) -> str:
    group = result.get("group_size", DEFAULT_GROUP_SIZE)
    lines = [f"# W4G{group} against llm-compressor: {result['model']}", "",
             f"`{result['command']}`", "",
             f"Machine: {result['machine'].get('cpu_model')}, {result['machine'].get('logical_cores')} logical CPUs; "
             f"calibration: {result['n_calib']} utterances of `{result['calib']}` (seed {result['seed']}; ours "
             f"computed in {result.get('compute_dtype', 'float32')}), the same windows for every method; every "
             f"Linear, the tied head included, symmetric int4 in groups of {group}. Load average (1, 5, 15 min) at "
             f"the start: {', '.join(str(v) for v in result.get('load_average_at_start', [])) or 'not recorded'}.", "",
             "Calibration s: the child process's wall clock (imports, model load, calibration, save); calibration "
             "proper s: the method's own clock for the work itself (ours: the windows, with TARQ's alignment pass, "
             "and the sequential calibration; llm-compressor's: its one-shot call).", "",
             "| data | method | calibration s | calibration proper s | peak RSS MiB | WER | rare-WER | capped rare-WER | "
             "loops | KLD rare | KLD common |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"| {r['dataset']} | {r['method']} | failed: {r['error']} |||||||||")
            continue
        lines.append(f"| {r['dataset']} | {r['method']} | {_clock(r, 'seconds')} | {_clock(r, 'stage_seconds')} | "
                     f"{r['peak_rss_mib']:.0f} | "
                     f"{_cell(r.get('wer'))} | {_cell(r.get('rare_wer'))} | {_cell(r.get('capped_rare_wer'))} | "
                     f"{r.get('loops', '—')} | {_cell(r.get('kld_rare'), 1, 4)} | {_cell(r.get('kld_common'), 1, 4)} |")
    lines += _round_notes(result["rows"])
    lines += ["", "Paired differences (95 % bootstrap intervals over utterances; * = excludes 0):", "",
              "| data | model | versus | Δ rare-WER (pp) | Δ WER (pp) | Δ KLD rare | Δ KLD common |",
              "|---|---|---|---|---|---|---|"]
    for d in result["differences"]:
        lines.append(f"| {d['dataset']} | {d['model']} | {d['versus']} | {_cell(d.get('rare_wer'))} | "
                     f"{_cell(d.get('wer'))} | {_cell(d.get('kld_rare'), 1, 4)} | {_cell(d.get('kld_common'), 1, 4)} |")
    return "\n".join(lines) + "\n"


def _clock(row: dict, key: str) -> str:
    """A clock's figure: the median and, over several rounds, the range of the rounds; a dash where none ran."""
    if row.get(key) is None:
        return "—"
    values = [r[key] for r in row.get("rounds", []) if r[key] is not None and not r["error"]]
    spread = f" ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else ""
    return f"{row[key]:.0f}{spread}"


def _round_notes(rows: list[dict]) -> list[str]:
    """Under the table, for several rounds: what the figures are, the ratios of the medians to llm-compressor's
    GPTQ, and whether each method wrote the same bytes in every round."""
    rounds = max((len(r.get("rounds", [])) for r in rows), default=0)
    if rounds < 2:
        return []
    notes = ["", f"Each calibration ran {rounds} times, the methods interleaved round by round; the clocks and peak "
                 "RSS are medians, the ranges those of the rounds."]
    peer = next((r for r in rows if r["method"] == "llmcompressor-gptq" and not r["error"]), None)
    for r in rows:
        if r["error"]:
            continue
        same = {True: "the same bytes in every round", False: "**different bytes between rounds**",
                None: "bytes not compared"}[r.get("same_result")]
        ratio = ""
        if peer is not None and r is not peer and r["method"] in OURS:
            ratio = f"; {r['seconds'] / peer['seconds']:.2f}x llm-compressor's process time"
            if r.get("stage_seconds") and peer.get("stage_seconds"):
                ratio += f", {r['stage_seconds'] / peer['stage_seconds']:.2f}x its calibration proper"
        notes.append(f"- {r['method']}: {same}{ratio}.")
    return notes


def differences(report: dict) -> list[dict]:
    """The paired differences between methods (not against the float model), decoded and teacher-forced together;
    with --teacher-forced-only there are only the teacher-forced ones."""
    out = []
    for dataset in report["datasets"]:
        figures = {(d["model"], d["versus"]): d for d in dataset.get("teacher_forced", {}).get("differences", [])}
        decoded = {(d["model"].split(" [")[0], d["versus"].split(" [")[0]): d for d in dataset.get("differences", [])}
        for model, versus in decoded or figures:
            if versus == REFERENCE:
                continue
            d, tf = decoded.get((model, versus), {}), figures.get((model, versus), {})
            out.append({"dataset": dataset["name"], "model": model, "versus": versus,
                        **{k: d[k] for k in ("wer", "rare_wer") if k in d},
                        **{k: tf[k] for k in ("kld_rare", "kld_common") if k in tf}})
    return out


# ----------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tarq_deploy.bench.peers", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="packaged:base", help="model source (as for tarq-deploy quantize)")
    p.add_argument("--calib", required=True, help="calibration manifest")
    p.add_argument("--n-calib", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", action="append", required=True, help="held-out [NAME=]MANIFEST (repeatable)")
    p.add_argument("--limit", type=int, help="only the first N utterances of each dataset")
    p.add_argument("--methods", default=",".join(OURS + PEERS), help="comma-separated: " + ", ".join(OURS + PEERS))
    p.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="the Python of llm-compressor's environment")
    p.add_argument("--threads", type=int, default=2, help="evaluation threads")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                   help="inputs per fp16 scale of the symmetric int4 lattice (128: the paper's W4G128; 32: ggml "
                        "Q4_0's)")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="float32",
                   help="our calibrations' forward passes (quantize --compute-dtype)")
    p.add_argument("--repeats", type=int, default=1,
                   help="calibrate each method this many times, round by round (ours, then the peers, then again): "
                        "the table gives the medians and ranges; the first round's results are scored")
    p.add_argument("--teacher-forced-only", action="store_true",
                   help="score by the teacher-forced figures alone (KLD on rare and common positions), no decoding")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> list[str]:
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in OURS + PEERS]
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(unknown)} (known: {', '.join(OURS + PEERS)})")
    if not Path(args.calib).is_file():
        raise UserError(f"--calib {args.calib}: no such manifest")
    for value in args.data:
        if not Path(value.split("=", 1)[-1]).is_file():
            raise UserError(f"--data {value}: no such manifest")
    if any(m in PEERS for m in methods) and not Path(args.peer_python).is_file():
        raise UserError(f"--peer-python {args.peer_python}: not found (make peers-venv installs llm-compressor there)")
    if args.group_size < 1:
        raise UserError(f"--group-size {args.group_size}: give at least 1")
    if args.n_calib < 1:
        raise UserError(f"--n-calib {args.n_calib}: give at least 1")
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: give at least 1")
    return methods


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = [round(v, 2) for v in os.getloadavg()]  # timings on a busy machine say little (README)
    try:
        methods = check(args)
        name = args.model.split(":")[-1].rstrip("/").split("/")[-1]
        out = Path(args.out)
        work = out / f"work-{name}"
        work.mkdir(parents=True, exist_ok=True)
        float_dir = write_float_model_and_windows(args.model, Path(args.calib), args.n_calib, args.seed, work)

        def calibrate(method: str, where: Path) -> Calibration:
            where.mkdir(parents=True, exist_ok=True)
            if method in OURS:
                return calibrate_ours(method, args.model, Path(args.calib), args.n_calib, args.seed, where,
                                      args.compute_dtype, args.group_size)
            return calibrate_peer(method, float_dir, work / "windows.safetensors", args.peer_python, where,
                                  args.group_size)

        rounds = [[calibrate(m, work if k == 1 else work / f"round-{k}") for m in methods]
                  for k in range(1, args.repeats + 1)]
        runs = over_rounds(rounds)
        report = evaluate(float_dir, runs, args.data, args.limit, args.threads, args.resamples, work,
                          args.teacher_forced_only)
    except UserError as error:
        print(f"python -m tarq_deploy.bench.peers: error: {error}", file=sys.stderr)
        return 2
    result = {"model": args.model, "calib": args.calib, "n_calib": args.n_calib, "seed": args.seed,
              "compute_dtype": args.compute_dtype, "group_size": args.group_size, "repeats": args.repeats,
              "command": "python -m tarq_deploy.bench.peers " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_record(), "load_average_at_start": load_at_start, "rows": summary(runs, report),
              "differences": differences(report)}
    write_text_atomic(out / f"peers-{name}.json", json.dumps(result, indent=1) + "\n")
    write_text_atomic(out / f"peers-{name}.md", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
