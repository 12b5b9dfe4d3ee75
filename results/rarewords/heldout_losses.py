"""Does a solver's per-layer gain on its calibration positions hold on positions it never saw? (issue 18, round 3)

For each lattice checkpoint and each corpus, the checkpoint is *replayed* through the sequential driver: block by
block, each Linear's statistics are gathered on the quantized stream exactly as calibration gathers them (earlier
Linears already at their lattice values), and instead of solving, the checkpoint's own lattice is put in place. The
per-position group losses of the paper (common L^C and tail L^T, tr(dW H dW^T) / N) are then computed for the
checkpoint's answer and for plain rounding. Replayed on the checkpoint's own calibration utterances this reproduces
the figures its calibration logged (a self-check); replayed on held-out utterances it shows what of the gain
generalises.

    python results/rarewords/heldout_losses.py --model packaged:base --checkpoint GPTQ=ck/GPTQ \
        --checkpoint TARQ=ck/TARQ --data calib=synth/calib.jsonl --data dev=synth/eval.jsonl --limit 128 --out DIR

Writes DIR/losses.json (per checkpoint, corpus and Linear: common/tail loss of the answer and of rounding) and
DIR/summary.md (per corpus and stage: the summed losses relative to rounding, and each checkpoint's loss relative to
the first one's, per Linear, as a geometric mean with its spread).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from tarq_deploy.checkpoint import load_checkpoint, read_manifest  # noqa: E402
from tarq_deploy.data.corpus import load_corpus  # noqa: E402
from tarq_deploy.models.registry import load_backbone  # noqa: E402
from tarq_deploy.quant.calibrate import CalibrationConfig, SequentialCalibrator, _assign  # noqa: E402
from tarq_deploy.quant.lattice_fit import quantize_rtn  # noqa: E402
from tarq_deploy.quant.pipeline import decode_utterances, full_float32  # noqa: E402
from tarq_deploy.quant.tarq import TarqConfig, group_losses  # noqa: E402


class _NoRecord:
    """What the driver logs for a replayed Linear: nothing (the losses go to ``Replay.rows``)."""

    def to_json(self) -> dict:
        return {}


class Replay(SequentialCalibrator):
    """The driver with the solver replaced by a lookup of the checkpoint's lattice."""

    def __init__(self, stages, windows, lattice, spec) -> None:
        super().__init__(stages, windows, CalibrationConfig(spec, TarqConfig(method="gptq")), None, log=lambda _: None)
        self.lattice = lattice
        self.rows: list[dict] = []

    def _solve(self, block, rel, stats):
        name = f"{block.full_name(rel)}.weight"
        linear = block.linear(rel)
        W = linear.weight.detach().float()
        q = self.lattice[name]
        common, tail = group_losses(W, q, stats)
        common_rtn, tail_rtn = group_losses(W, quantize_rtn(W, q.spec), stats)
        self.rows.append({"name": block.full_name(rel), "n_common": stats.n_common, "n_tail": stats.n_tail,
                          "common": common, "tail": tail, "common_rtn": common_rtn, "tail_rtn": tail_rtn})
        _assign(linear, q)
        return q, _NoRecord()


def replay(model: str, checkpoint: Path, utterances, limit: int) -> list[dict]:
    """Per-Linear losses of the checkpoint's lattice on ``utterances`` (its calibration set, in calibration order,
    when the corpus holds it)."""
    ckpt = load_checkpoint(checkpoint)
    method = ckpt.metadata["method"]
    backbone = load_backbone(model, "cpu", method.get("head_identity_weight", 1.0))
    by_id = {u.id: u for u in utterances}
    calibrated = ckpt.metadata.get("calibration", {}).get("ids", [])
    if calibrated and all(i in by_id for i in calibrated):  # the checkpoint's own calibration set, in its order
        utterances = [by_id[i] for i in calibrated]
    windows = backbone.build_windows(decode_utterances(utterances[:limit]), method["zipf_threshold"], method["pack"],
                                     method["encoder_tagging"])
    runner = Replay(backbone.stages(), windows, ckpt.quantized, ckpt.spec)
    with full_float32(), torch.no_grad():
        runner.run()
    return runner.rows


STAGES = ("encoder", "decoder blocks", "head")


def stage_of(name: str) -> str:
    """The encoder, the decoder's blocks, or the output head (Whisper's tied proj_out, where tokens are decided)."""
    if ".encoder." in f".{name}":
        return "encoder"
    return "head" if name.endswith("proj_out") else "decoder blocks"


def summary(results: dict, labels: list[str], corpora: list[str]) -> str:
    base = labels[0]
    lines = ["| corpus | stage | model | tail / RTN | common / RTN | tail vs " + base + " (geo. mean per Linear) "
             "| common vs " + base + " | Linears with lower tail loss than " + base + " |",
             "|---|---|---|---|---|---|---|---|"]
    for corpus in corpora:
        for stage in STAGES:
            ref = {r["name"]: r for r in results[base][corpus] if stage_of(r["name"]) == stage}
            for label in labels:
                rows = [r for r in results[label][corpus] if stage_of(r["name"]) == stage]
                tail = sum(r["tail"] for r in rows) / sum(r["tail_rtn"] for r in rows)
                common = sum(r["common"] for r in rows) / sum(r["common_rtn"] for r in rows)
                log_t = [math.log(r["tail"] / ref[r["name"]]["tail"]) for r in rows if ref[r["name"]]["tail"] > 0]
                log_c = [math.log(r["common"] / ref[r["name"]]["common"]) for r in rows]
                lower = sum(x < 0 for x in log_t)
                lines.append(f"| {corpus} | {stage} | {label} | {tail:.3f} | {common:.3f} | "
                             f"{math.exp(sum(log_t) / len(log_t)):.3f} | {math.exp(sum(log_c) / len(log_c)):.3f} | "
                             f"{lower} of {len(log_t)} |")
    return "\n".join(lines) + "\n"


def self_check(label: str, by_corpus: dict, logged: list[dict]) -> str:
    """The largest relative difference between a replay and the losses calibration logged, per corpus: ~0 on the
    corpus the checkpoint was calibrated on."""
    logged_by_name = {r["name"]: r for r in logged if r.get("tail_loss_final") is not None}
    lines = []
    for corpus, rows in by_corpus.items():
        worst = max((abs(r["tail"] - logged_by_name[r["name"]]["tail_loss_final"]) /
                     max(logged_by_name[r["name"]]["tail_loss_final"], 1e-30)
                     for r in rows if r["name"] in logged_by_name), default=float("nan"))
        lines.append(f"- {label} on {corpus}: largest relative difference from the logged tail loss {worst:.2e}")
    return "\n" + "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--checkpoint", action="append", required=True, metavar="LABEL=DIR")
    p.add_argument("--data", action="append", required=True, metavar="NAME=MANIFEST")
    p.add_argument("--limit", type=int, default=128, help="utterances of each corpus")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    checkpoints = dict(item.split("=", 1) for item in args.checkpoint)
    corpora = dict(item.split("=", 1) for item in args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "losses.json"
    results: dict = json.loads(cache.read_text()) if cache.is_file() else {}
    for label, directory in checkpoints.items():
        for corpus, manifest in corpora.items():
            if corpus in results.get(label, {}):
                continue
            print(f"replaying {label} on {corpus}", flush=True)
            results.setdefault(label, {})[corpus] = replay(args.model, Path(directory), load_corpus(manifest), args.limit)
            cache.write_text(json.dumps(results, indent=1))  # resumable: one (checkpoint, corpus) at a time
    text = summary(results, list(checkpoints), list(corpora))
    for label, directory in checkpoints.items():
        text += self_check(label, results[label], read_manifest(directory)["layers"])  # the log, not the lattice
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
