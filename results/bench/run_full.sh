#!/usr/bin/env bash
# The full CPU bench of the benchmark issue: whisper.cpp F16 vs TARQ Q4_0 for tiny.en and base, on jfk.wav (11 s)
# and 30 s of a real lecture, threads 1,2,4,8,16, 1 warm-up + 3 timed runs per cell, each a fresh process.
# Run from the repository root on an otherwise idle machine; model files go to $WORK (default /tmp/tarq-bench).
# The TARQ checkpoints are calibrated on the synthetic rare-word corpus's calibration split (128 utterances).
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
WORK=${WORK:-/tmp/tarq-bench}
TD=(python -m tarq_deploy.cli)

[ -f "$WORK/synth/calib.jsonl" ] || "${TD[@]}" corpus synth --out "$WORK/synth" --n 200 --n-calib 128 \
    --voices slt,joe --seed 0
models=()
for name in tiny.en base; do
  [ -d "$WORK/ckpt-$name-tarq" ] || "${TD[@]}" quantize --model "packaged:$name" --calib "$WORK/synth/calib.jsonl" \
      --method tarq --target whisper.cpp --n-calib 128 --out "$WORK/ckpt-$name-tarq"
  "${TD[@]}" export --target whisper.cpp --model "packaged:$name" --type f16 -o "$WORK/$name-f16.bin" --quiet
  "${TD[@]}" export --target whisper.cpp "$WORK/ckpt-$name-tarq" -o "$WORK/$name-tarq-q4_0.bin" --quiet
  "${TD[@]}" verify "$WORK/$name-tarq-q4_0.bin" --against "$WORK/ckpt-$name-tarq"
  models+=(--model "$WORK/$name-f16.bin" --model "$WORK/$name-tarq-q4_0.bin")
done
"${TD[@]}" bench "${models[@]}" --audio jfk --audio lecture-30s --threads 1,2,4,8,16 --warmup 1 --runs 3 \
    --out results/bench --name whisper-cpp-cpu-tarq
