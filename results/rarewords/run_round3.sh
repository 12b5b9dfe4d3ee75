#!/usr/bin/env bash
# Round 3 of issue 18 (round3/PLAN.md, committed before any score): Whisper base at every method's defaults -- ggml's
# rounding, imatrix, GPTQ, TARQ -- as whisper.cpp Q4_0 files, on an 800-utterance held-out test split (festival KAL, a
# voice neither calibration nor dev hears), calibrated on 128 sentences no earlier round used. Words from whisper.cpp
# (1 thread, greedy), teacher-forced figures from PyTorch on the same lattices. The primary report covers all 800; the
# secondary covers the 600 sentences rounds 1-2 never scored. Run from the repository root; $WORK defaults to
# /tmp/r3; the reports go to results/rarewords/round3/. Resumable: what exists is reused.
WORK=${WORK:-/tmp/r3}
source "$(dirname "$0")/checkpoints.sh"

"${TD[@]}" corpus synth --out "$SYNTH" --n 200 --n-test 800 --n-calib 128 --voices slt,joe --test-voices kal --seed 0
for method in rtn imatrix gptq tarq; do
  checkpoint "${method^^}" "$method"
done
[ -f "$WORK/bin/F16.bin" ] || "${TD[@]}" export --target whisper.cpp --model "$MODEL" --type f16 \
    -o "$WORK/bin/F16.bin" --quiet

# The secondary set: test utterances 200..799 (the first 200 are rounds 1-2's test sentences).
python - "$SYNTH/test.jsonl" "$SYNTH/test-new600.jsonl" <<'PY'
import sys
lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
assert len(lines) == 800, len(lines)
open(sys.argv[2], "w", encoding="utf-8").write("\n".join(lines[200:]) + "\n")
PY

models=()
for label in F16 RTN IMATRIX GPTQ TARQ; do
  models+=(--model "$label=$WORK/bin/$label.bin")
done
for data in test test-new600; do
  out="$WORK/eval-$data"
  if [ "$data" = test-new600 ]; then  # the 600 are a subset of the 800: their decoded words are reused, not redone
    mkdir -p "$out/hypotheses"
    for f in "$WORK"/eval-test/hypotheses/*__test.jsonl; do
      g="$out/hypotheses/$(basename "${f%__test.jsonl}")__test-new600.jsonl"
      [ -f "$g" ] || cp "$f" "$g"
    done
  fi
  "${TD[@]}" eval --data "$data=$SYNTH/$data.jsonl" --tokenizer "$MODEL" --backend whisper.cpp "${models[@]}" \
      --reference F16 --teacher-forced --compare TARQ:RTN --compare TARQ:IMATRIX --compare TARQ:GPTQ \
      --compare GPTQ:RTN --compare GPTQ:IMATRIX --focus TARQ --threads 1 --jobs 2 --resamples 2000 --out "$out" --quiet
  mkdir -p results/rarewords/round3/"$data"
  cp "$out/report.md" "$out/report.json" results/rarewords/round3/"$data"/
done
python results/rarewords/tracking.py results/rarewords/round3/test/report.json results/rarewords/round3/test \
    --title "Round 3 test split (800 utt., unseen voice), Whisper base, whisper.cpp Q4_0"
