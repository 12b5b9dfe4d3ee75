#!/bin/bash
# Issue 38 item 2: does rotating Whisper's attention heads (quantize --rotate heads) help, per type and method?
# Whisper base, 128 synthetic calibration utterances, teacher-forced KLD against F16 on the 200-utterance dev split
# (voices slt, joe). Run from the repository root after `make install`; W is scratch space (about 2 GB).
set -eu
W=${W:-/tmp/rotation}
T=".venv/bin/tarq-deploy"
mkdir -p "$W/ck"
[ -f "$W/synth/eval.jsonl" ] || $T corpus synth --out "$W/synth" --n 200 --n-calib 128 --n-test 200 --seed 0
# batch a: rtn and tarq at four types; batch b: tarq at the 2-bit types, gptq at q3_k
for spec in rtn:q4_0 tarq:q4_0 rtn:q3_k tarq:q3_k rtn:iq3_s tarq:iq3_s rtn:iq3_xxs tarq:iq3_xxs \
            tarq:iq2_s tarq:q2_k gptq:q3_k; do
  method=${spec%%:*} type=${spec##*:}
  for rot in none heads; do
    out="$W/ck/$method-$type-$rot"
    [ -f "$out/manifest.json" ] || $T quantize --model packaged:base --calib "$W/synth/calib.jsonl" --n-calib 128 \
      --method "$method" --type "$type" --rotate "$rot" --out "$out"
  done
done
args=(--data "dev=$W/synth/eval.jsonl" --reference F16 --teacher-forced-only --model F16=packaged:base --backend torch
      --resamples 2000 --threads 2 --quiet)
for ck in "$W"/ck/*/; do
  n=$(basename "$ck")
  args+=(--model "$n=$ck")
  case $n in *-none) args+=(--compare "${n%-none}-heads:$n");; esac
done
$T eval "${args[@]}" -o "$W/eval"
