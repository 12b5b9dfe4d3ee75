#!/bin/bash
# The tied head's identity weight mu (--head-identity-weight) at 3.44 and 2.3-2.6 bits, Whisper base, dev split only.
# Calibration: the 128 synthetic utterances of corpora/synth (tarq-deploy corpus synth --out corpora/synth --n 200
# --n-calib 128 --n-test 200 --seed 0); every other option at its default (--rotate auto rotates these types).
set -eu
W=${W:-runs/head-identity}; T=${T:-.venv/bin/tarq-deploy}
mkdir -p $W
$T quantize --model packaged:base --method ggml --type q4_0 --out $W/ggml-q4_0
for spec in iq3_s:1 iq3_s:4 iq3_s:16 iq3_s:0.25 iq2_xs:1 iq2_xs:4 iq2_xs:16 iq2_s:1 iq2_s:4; do
  type=${spec%:*}; mu=${spec#*:}
  $T quantize --model packaged:base --calib corpora/synth/calib.jsonl --n-calib 128 --method tarq --type $type \
      --head-identity-weight $mu --out $W/tarq-$type-mu$mu
done
# teacher-forced against F16 (eval-dev-report.*; eval-dev-iq2_s-report.* is the same command for the IQ2_S pair)
args=(--data dev=corpora/synth/eval.jsonl --reference F16 --teacher-forced-only --model F16=packaged:base
      --backend torch --resamples 2000 --threads 2 --quiet --model ggml-q4_0=$W/ggml-q4_0)
for spec in iq3_s:1 iq3_s:4 iq3_s:16 iq3_s:0.25 iq2_xs:1 iq2_xs:4 iq2_xs:16; do
  type=${spec%:*}; mu=${spec#*:}; n=tarq-$type-mu$mu
  args+=(--model $n=$W/$n)
  [ "$mu" = 1 ] || args+=(--compare $n:tarq-$type-mu1)
  [ "$type" = iq3_s ] && args+=(--compare $n:ggml-q4_0)
done
$T eval "${args[@]}" -o $W/eval-dev
$T eval --data dev=corpora/synth/eval.jsonl --reference F16 --teacher-forced-only --model F16=packaged:base \
    --backend torch --resamples 2000 --threads 2 --quiet --model tarq-iq2_s-mu1=$W/tarq-iq2_s-mu1 \
    --model tarq-iq2_s-mu4=$W/tarq-iq2_s-mu4 --compare tarq-iq2_s-mu4:tarq-iq2_s-mu1 -o $W/eval-dev-iq2_s
# decoded by stock whisper.cpp (eval-dev-decoded-report.*)
for n in tarq-iq2_s-mu1 tarq-iq2_s-mu4 tarq-iq2_xs-mu1 tarq-iq2_xs-mu4; do
  $T export --target whisper.cpp --checkpoint $W/$n --out $W/$n.bin
done
$T eval --data dev=corpora/synth/eval.jsonl --threads 1 --jobs 2 --resamples 2000 --quiet \
    --model tarq-iq2_s-mu1=$W/tarq-iq2_s-mu1.bin --model tarq-iq2_s-mu4=$W/tarq-iq2_s-mu4.bin \
    --model tarq-iq2_xs-mu1=$W/tarq-iq2_xs-mu1.bin --model tarq-iq2_xs-mu4=$W/tarq-iq2_xs-mu4.bin \
    --compare tarq-iq2_s-mu4:tarq-iq2_s-mu1 --compare tarq-iq2_xs-mu4:tarq-iq2_xs-mu1 -o $W/eval-dev-decoded
