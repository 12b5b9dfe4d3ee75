#!/bin/bash
# The same question for our GPTQ at Q3_K (run.sh asks it of TARQ): does --refit-scales help a plain-metric solve?
set -eu
W=${W:-/tmp/refit}
T=".venv/bin/tarq-deploy"
for refit in no-refit refit; do
  out="$W/ck/gptq-q3_k-$refit"
  [ -f "$out/manifest.json" ] || $T quantize --model packaged:base --calib "$W/synth/calib.jsonl" --n-calib 128 \
    --method gptq --type q3_k "--$refit-scales" --out "$out"
done
$T eval --data "dev=$W/synth/eval.jsonl" --reference F16 --teacher-forced-only --model F16=packaged:base \
  --backend torch --resamples 2000 --threads 2 --quiet --model "gptq-q3_k=$W/ck/gptq-q3_k-no-refit" \
  --model "gptq-q3_k-refit=$W/ck/gptq-q3_k-refit" --compare "gptq-q3_k-refit:gptq-q3_k" -o "$W/eval-gptq"
