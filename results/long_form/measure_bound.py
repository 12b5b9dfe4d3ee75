"""How far a long recording's whole-text WER lies from the per-utterance WER of the same utterances, per backend and
decode profile: the spread that sets the bound of tests/test_long_form_decode.py.

    python results/long_form/measure_bound.py --data corpora/synth/eval.jsonl --seeds 0,1,2 --out results/long_form

Builds one recording of 3-3.5 min per seed from the manifest (data/long_form.py, as `corpus long` does), decodes it
whole and its utterances one at a time with whisper.cpp (tiny.en F16) and PyTorch (packaged:tiny.en), and writes
bound.json: per (seed, backend, profile) the two WERs and their difference."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tarq_deploy import cli
from tarq_deploy.data.corpus import load_audio, load_corpus
from tarq_deploy.data.long_form import build_long_recordings
from tarq_deploy.evaluate.wer import score_utterance, totals
from tarq_deploy.machine import machine_record
from tarq_deploy.runtimes.base import DecodeOptions, ModelSpec
from tarq_deploy.runtimes.registry import open_transcriber


def _wer(t) -> float:
    return t.errors / t.words


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--profiles", default="greedy,cli")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    utterances = load_corpus(args.data)
    audios = [load_audio(u) for u in utterances]
    by_id = dict(zip((u.id for u in utterances), zip(utterances, audios)))
    work = Path(tempfile.mkdtemp())
    f16 = work / "tiny.en-f16.bin"
    assert cli.main(["export", "--model", "packaged:tiny.en", "-o", str(f16), "--quiet"]) == 0
    rows = []
    for seed in map(int, args.seeds.split(",")):
        recording = build_long_recordings(utterances, audios, (180.0, 210.0), seed)[0]
        parts = [s.utterance_id for s in recording.spans if s.kind == "speech"]
        for backend, source in (("whisper.cpp", str(f16)), ("torch", "packaged:tiny.en")):
            for profile in args.profiles.split(","):
                run = open_transcriber(ModelSpec("f16", source, backend),
                                       DecodeOptions(threads=args.threads, profile=profile))
                try:
                    whole = score_utterance(recording.id, recording.transcript, run.transcribe(recording.audio, "long"))
                    pieces = [score_utterance(uid, by_id[uid][0].text, run.transcribe(by_id[uid][1], uid))
                              for uid in parts]
                finally:
                    run.close()
                long_wer, utt_wer = _wer(totals([whole])), _wer(totals(pieces))
                rows.append({"seed": seed, "backend": backend, "profile": profile, "minutes": len(recording.audio) / 16000 / 60,
                             "utterances": len(parts), "long_wer": long_wer, "per_utterance_wer": utt_wer,
                             "difference": long_wer - utt_wer})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bound.json").write_text(json.dumps({"rows": rows, "machine": machine_record(),
                                                "loadavg_start": os.getloadavg()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
