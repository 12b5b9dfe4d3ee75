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
# three rotation draws of Q3_K and IQ3_S (seeds 1 and 2 here; seed 0 above), and the control: unrotated at seed 1
for type in q3_k iq3_s; do
  for seed in 1 2; do
    $T quantize --model packaged:base --calib "$W/synth/calib.jsonl" --n-calib 128 --method tarq --type $type \
      --rotate heads --seed $seed --out "$W/seeds/tarq-$type-heads-seed$seed"
  done
  $T quantize --model packaged:base --calib "$W/synth/calib.jsonl" --n-calib 128 --method tarq --type $type \
    --rotate none --seed 1 --out "$W/seeds/tarq-$type-none-seed1"
done
args=(--data "dev=$W/synth/eval.jsonl" --reference F16 --teacher-forced-only --model F16=packaged:base --backend torch
      --resamples 2000 --threads 2 --quiet)
for type in q3_k iq3_s; do
  args+=(--model "tarq-$type-none=$W/ck/tarq-$type-none" --model "tarq-$type-none-seed1=$W/seeds/tarq-$type-none-seed1"
         --compare "tarq-$type-none-seed1:tarq-$type-none")
  for seed in 1 2; do
    args+=(--model "tarq-$type-heads-seed$seed=$W/seeds/tarq-$type-heads-seed$seed"
           --compare "tarq-$type-heads-seed$seed:tarq-$type-none")
  done
done
$T eval "${args[@]}" -o "$W/seeds/eval"
# 2026-11-29: the IQ2_XS cell (TARQ, none and heads), calibrated on this project's corpora/synth/calib.jsonl (seed 0)
# and scored on its dev split; as run, the whisper.cpp files exported from these checkpoints were scored
for rot in none heads; do
  $T quantize --model packaged:base --calib corpora/synth/calib.jsonl --n-calib 128 --method tarq --type iq2_xs \
    --rotate $rot --out "$W/iq2_xs/tarq-iq2_xs-$rot"
  $T export --target whisper.cpp "$W/iq2_xs/tarq-iq2_xs-$rot" -o "$W/iq2_xs/tarq-iq2_xs-$rot.bin" --quiet
done
$T eval --data dev=corpora/synth/eval.jsonl --reference F16 --teacher-forced-only --model F16=packaged:base \
  --backend torch --resamples 2000 --threads 2 --quiet --model "tarq-iq2_xs-none=$W/iq2_xs/tarq-iq2_xs-none.bin" \
  --model "tarq-iq2_xs-heads=$W/iq2_xs/tarq-iq2_xs-heads.bin" --compare tarq-iq2_xs-heads:tarq-iq2_xs-none \
  -o "$W/iq2_xs/eval"
