"""Does calibration fit the decoder to the token shape it was calibrated on?  (issue 61, item 6: the mechanism)

Calibration runs the decoder teacher-forced on `<|sot|> <|en|> <|transcribe|> <|notimestamps|> text <|eot|>`: no
timestamp tokens, no carried text, at most ~100 positions. whisper-cli decodes with timestamps, and within a
recording each window starts with `<|startofprev|>` and the previous window's tokens (up to 223). GPTQ-family solvers
minimise the error along the activations they were shown; directions the calibration never excites (the timestamp
tokens' embeddings, late positions, the prev-text prompt) are left to whatever the column updates push onto them.

This probe measures it without decoding: every file teacher-forced on the same packed windows in three shapes,
KL(P_F16 || Q) at the positions that predict a text token (and, for the timestamped shapes, a timestamp token):
  plain:     the calibration's own shape
  stamped:   `<|sot|> <|en|> <|transcribe|> <|t0|> text1 <|t1|><|t2|> text2 ... <|eot|>` (the packing's own times)
  carried:   `<|startofprev|>` + the previous window's stamped tokens (last 223) + the stamped shape

Run from the repository root with .venv active:
    python results/cliform/probe.py --data corpora/terms/test.jsonl --tokenizer packaged:base \\
        f16=runs/terms/files/f16.bin ggml-q4_0=runs/terms/files/ggml-q4_0.bin ... > results/cliform/probe.json
The first model is the reference.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from tarq_deploy.data.corpus import TARGET_SAMPLE_RATE, load_audio, load_corpus
from tarq_deploy.data.rarity import decoder_text
from tarq_deploy.evaluate.teacher_forced import TeacherForcedScorer, pack_windows
from tarq_deploy.machine import machine_record
from tarq_deploy.models.common import TextAudio, joined
from tarq_deploy.runtimes.base import ModelSpec
from tarq_deploy.runtimes.torch_whisper import load_torch_bundle

SHAPES = ("plain", "stamped", "carried")
GAP_SECONDS = 0.3  # pack_utterances' silence between utterances
SECONDS_PER_STAMP = 0.02
MAX_PREVIOUS = 223  # whisper.cpp: n_text_ctx / 2 - 1 tokens of carried text


def text_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(decoder_text(text), add_special_tokens=False).input_ids


def window_shapes(generation_config, tokenizer, prompt: list[int], texts: list[str], seconds: list[float],
                  previous: list[int]) -> dict[str, tuple[list[int], list[str]]]:
    """Each shape's ids and, per position, what the next token is ('text', 'stamp', 'eot', '' for the prompt)."""
    gc = generation_config
    stamp0 = gc.no_timestamps_token_id + 1
    body = prompt[:-1]  # without <|notimestamps|>
    plain, plain_kind = list(prompt), [""] * (len(prompt) - 1)
    stamped, stamped_kind = list(body), [""] * (len(body) - 1)
    start = 0.0
    for text, length in zip(texts, seconds):
        tokens = text_tokens(tokenizer, text)
        plain += tokens
        plain_kind += ["text"] * len(tokens)
        stamped += [stamp0 + round(start / SECONDS_PER_STAMP)] + tokens + \
            [stamp0 + min(1500, round((start + length) / SECONDS_PER_STAMP))]
        stamped_kind += ["stamp"] + ["text"] * len(tokens) + ["stamp"]
        start += length + GAP_SECONDS
    plain += [gc.eos_token_id]
    plain_kind += ["eot"]
    stamped += [gc.eos_token_id]
    stamped_kind += ["eot"]
    carried_prefix = [gc.prev_sot_token_id] + previous[-MAX_PREVIOUS:]
    carried = carried_prefix + stamped
    carried_kind = [""] * len(carried_prefix) + stamped_kind
    return {"plain": (plain, plain_kind), "stamped": (stamped, stamped_kind), "carried": (carried, carried_kind)}


def kld(reference: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(model.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("models", nargs="+", help="LABEL=PATH; the first is the reference")
    args = parser.parse_args()
    torch.set_num_threads(2)
    utterances = load_corpus(args.data)
    audio = [load_audio(u) for u in utterances]
    items = [(u.id, a, u.text) for u, a in zip(utterances, audio)]
    labels = [m.split("=", 1)[0] for m in args.models]
    scorers = {m.split("=", 1)[0]: TeacherForcedScorer(load_torch_bundle(
        ModelSpec(m.split("=", 1)[0], m.split("=", 1)[1], "torch", args.tokenizer))[0]) for m in args.models}
    ref = scorers[labels[0]]
    b = ref.backbone
    tokenizer, gc = b.processor.tokenizer, b.generation_config
    # per model, shape, kind: every position's KLD, with the window it belongs to (for a bootstrap over windows)
    rows: dict[str, dict[str, dict[str, list]]] = {l: {s: {} for s in SHAPES} for l in labels[1:]}
    previous: list[int] = []
    began = time.time()
    for w, window in enumerate(pack_windows(items)):
        members = [items[i] for i in window]
        joined_audio, _ = joined([TextAudio(i, a, t) for i, a, t in members])
        features = ref.features(joined_audio)
        shapes = window_shapes(gc, tokenizer, b.prompt_ids(), [t for _, _, t in members],
                               [len(a) / TARGET_SAMPLE_RATE for _, a, _ in members], previous)
        for shape, (ids, kinds) in shapes.items():
            first = len(ids) - 1 - len(kinds)
            ref_logits = ref.logits(features, ids, first)
            kinds_t = np.array(kinds)
            for label in labels[1:]:
                d = kld(ref_logits, scorers[label].logits(features, ids, first)).numpy()
                for kind in ("text", "stamp", "eot"):
                    at = kinds_t == kind
                    if at.any():
                        rows[label][shape].setdefault(kind, []).append((w, float(d[at].sum()), int(at.sum())))
        previous = [t for t in shapes["stamped"][0][len(b.prompt_ids()) - 1:-1]]
        print(f"window {w}: {len(members)} utterances, {time.time() - began:.0f} s", file=sys.stderr)
    json.dump({"data": args.data, "models": args.models, "machine": machine_record(),
               "summary": summarize(rows), "rows": rows}, sys.stdout, indent=1)


def summarize(rows: dict, resamples: int = 2000, seed: int = 0) -> dict:
    """Mean KLD per position for each (model, shape, kind), and the carried − plain difference at text positions
    with a 95 % bootstrap interval over windows (the same windows resampled for both shapes)."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for label, shapes in rows.items():
        out[label] = {}
        for shape, kinds in shapes.items():
            for kind, items in kinds.items():
                total = sum(s for _, s, _ in items)
                count = sum(n for _, _, n in items)
                out[label][f"{shape}/{kind}"] = round(total / count, 5)
        for shape in ("stamped", "carried"):
            a = np.array([(s, n) for _, s, n in shapes[shape]["text"]])
            base = np.array([(s, n) for _, s, n in shapes["plain"]["text"]])
            idx = rng.integers(0, len(a), size=(resamples, len(a)))
            diff = a[idx, 0].sum(1) / a[idx, 1].sum(1) - base[idx, 0].sum(1) / base[idx, 1].sum(1)
            point = a[:, 0].sum() / a[:, 1].sum() - base[:, 0].sum() / base[:, 1].sum()
            out[label][f"{shape}-plain/text"] = [round(point, 5), round(float(np.quantile(diff, 0.025)), 5),
                                                 round(float(np.quantile(diff, 0.975)), 5)]
    return out


if __name__ == "__main__":
    main()
