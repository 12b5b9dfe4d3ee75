#!/bin/bash
# Held out, after run.sh chose the default: TARQ Q3_K and IQ3_S (3.44 bits per weight, refit on: the default) against
# ggml's Q4_0 (4.5 bits: `--method ggml`, the bytes of ggml's own quantizer), teacher-forced rare/common KLD against
# F16 in PyTorch on the first 100 test utterances (unseen sentences, the unseen voice kal). Same W as run.sh.
set -eu
W=${W:-/tmp/refit}
T=".venv/bin/tarq-deploy"
[ -f "$W/ck/ggml-q4_0/manifest.json" ] || $T quantize --model packaged:base --method ggml --type q4_0 --out "$W/ck/ggml-q4_0"
[ -f "$W/ck/tarq-iq3_s-refit/manifest.json" ] || $T quantize --model packaged:base --calib "$W/synth/calib.jsonl" \
  --n-calib 128 --method tarq --type iq3_s --out "$W/ck/tarq-iq3_s-refit"
$T eval --data "test=$W/synth/test.jsonl" --limit 100 --reference F16 --teacher-forced-only --model F16=packaged:base \
  --backend torch --resamples 2000 --threads 2 --quiet --model "ggml-q4_0=$W/ck/ggml-q4_0" \
  --model "tarq-q3_k=$W/ck/tarq-q3_k-refit" --model "tarq-iq3_s=$W/ck/tarq-iq3_s-refit" \
  --model "tarq-q3_k-no-refit=$W/ck/tarq-q3_k-no-refit" \
  --compare "tarq-q3_k:ggml-q4_0" --compare "tarq-iq3_s:ggml-q4_0" --compare "tarq-q3_k:tarq-q3_k-no-refit" \
  -o "$W/eval-heldout"
# the same comparison for the other two types the dev split measured with a visible change (Q2_K) or none (IQ3_S)
$T eval --data "test=$W/synth/test.jsonl" --limit 100 --reference F16 --teacher-forced-only --model F16=packaged:base \
  --backend torch --resamples 2000 --threads 2 --quiet --model "tarq-q2_k=$W/ck/tarq-q2_k-refit" \
  --model "tarq-q2_k-no-refit=$W/ck/tarq-q2_k-no-refit" --model "tarq-iq3_s=$W/ck/tarq-iq3_s-refit" \
  --model "tarq-iq3_s-no-refit=$W/ck/tarq-iq3_s-no-refit" \
  --compare "tarq-q2_k:tarq-q2_k-no-refit" --compare "tarq-iq3_s:tarq-iq3_s-no-refit" -o "$W/eval-heldout-2"
