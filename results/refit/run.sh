#!/bin/bash
# Issue 38 item 3: does refitting the sub-block scale codes after the sweep (quantize --refit-scales) help? TARQ of
# Whisper base at the two-level types, 128 synthetic calibration utterances, every other option at its default;
# teacher-forced KLD against F16 on the 200-utterance dev split (voices slt, joe; never the test split). Run from
# the repository root after `make install`; W is scratch space (about 1 GB).
set -eu
W=${W:-/tmp/refit}
T=".venv/bin/tarq-deploy"
mkdir -p "$W/ck"
[ -f "$W/synth/eval.jsonl" ] || $T corpus synth --out "$W/synth" --n 200 --n-calib 128 --n-test 200 --seed 0
TYPES="q3_k q2_k q4_k iq3_s"
for type in $TYPES; do
  for refit in no-refit refit; do
    out="$W/ck/tarq-$type-$refit"
    [ -f "$out/manifest.json" ] || /usr/bin/time -f "tarq $type $refit wall %e s" -a -o "$W/times.txt" \
      $T quantize --model packaged:base --calib "$W/synth/calib.jsonl" --n-calib 128 --method tarq --type "$type" \
      "--$refit-scales" --out "$out"
  done
done
args=(--data "dev=$W/synth/eval.jsonl" --reference F16 --teacher-forced-only --model F16=packaged:base --backend torch
      --resamples 2000 --threads 2 --quiet)
for type in $TYPES; do
  args+=(--model "tarq-$type=$W/ck/tarq-$type-no-refit" --model "tarq-$type-refit=$W/ck/tarq-$type-refit"
         --compare "tarq-$type-refit:tarq-$type")
done
$T eval "${args[@]}" -o "$W/eval"
