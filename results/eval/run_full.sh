#!/usr/bin/env bash
# The full evaluation of issue 5 on real Whisper tiny.en (see README.md beside this file). Run from the repository
# root; corpora, checkpoints and model files go to $WORK (default /tmp/tarq-eval), the tables to results/eval/.
# Every step resumes: audio, checkpoints and hypotheses already made are reused.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE  # a shared CPU: busy-waiting OpenMP threads make everything crawl
WORK=${WORK:-/tmp/tarq-eval}
TD=(python -m tarq_deploy.cli)

"${TD[@]}" corpus real --out "$WORK/real"
"${TD[@]}" corpus synth --out "$WORK/synth" --n 200 --n-calib 128 --voices slt,joe --seed 0

"${TD[@]}" export --target whisper.cpp --model packaged:tiny.en -o "$WORK/tiny-f16.bin" --quiet
"${TD[@]}" export --target whisper.cpp --model packaged:tiny.en --baseline rtn --type q4_0 \
    -o "$WORK/tiny-rtn-q4_0.bin" --quiet
for method in gptq tarq; do
  for group in 128 32; do
    ckpt="$WORK/ckpt-$method-g$group"
    [ -d "$ckpt" ] || "${TD[@]}" quantize --model packaged:tiny.en --calib "$WORK/synth/calib.jsonl" \
        --method "$method" --group-size "$group" --n-calib 128 --out "$ckpt"
    "${TD[@]}" export --target whisper.cpp "$ckpt" -o "$WORK/tiny-$method-g$group-q4_0.bin" --quiet
  done
done

models=(--model "F16=packaged:tiny.en" --backend torch
        --model "F16=$WORK/tiny-f16.bin" --backend whisper.cpp
        --model "RTN Q4_0=$WORK/tiny-rtn-q4_0.bin" --backend torch
        --model "RTN Q4_0=$WORK/tiny-rtn-q4_0.bin" --backend whisper.cpp)
for method in gptq tarq; do
  for group in 128 32; do
    label="${method^^} g$group"
    models+=(--model "$label=$WORK/ckpt-$method-g$group" --backend torch
             --model "$label=$WORK/tiny-$method-g$group-q4_0.bin" --backend whisper.cpp)
  done
done
"${TD[@]}" eval --data "$WORK/synth/eval.jsonl" --data "$WORK/real/eval.jsonl" "${models[@]}" \
    --threads 1 --jobs 2 --focus "TARQ g32" --compare "TARQ g128:GPTQ g128" --compare "TARQ g32:GPTQ g32" \
    --compare "TARQ g32:RTN Q4_0" \
    --out "$WORK/eval" --quiet
cp "$WORK/eval/report.md" "$WORK/eval/report.json" results/eval/
