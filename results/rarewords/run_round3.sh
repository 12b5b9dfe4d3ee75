#!/usr/bin/env bash
# Round 3 of issue 18 (round3/PLAN.md, committed before any score): Whisper base at every method's defaults -- ggml's
# rounding, imatrix, GPTQ, TARQ -- as whisper.cpp Q4_0 files, on an 800-utterance held-out test split (festival KAL, a
# voice neither calibration nor dev hears), calibrated on 128 sentences no earlier round used. Words from whisper.cpp
# (1 thread, greedy), teacher-forced figures from PyTorch on the same lattices. The primary report covers the first 600
# test utterances (round3/PLAN.md, "Amendment": decoding all 800 did not fit the session); the secondary covers the 400
# of them that rounds 1-2 never scored. Run from the repository root; $WORK defaults to
# /tmp/r3; the reports go to results/rarewords/round3/. Resumable: what exists is reused.
WORK=${WORK:-/tmp/r3}
source "$(dirname "$0")/checkpoints.sh"

"${TD[@]}" corpus synth --out "$SYNTH" --n 200 --n-test 800 --n-calib 128 --voices slt,joe --test-voices kal --seed 0
for method in rtn imatrix gptq tarq; do
  checkpoint "${method^^}" "$method"
done
[ -f "$WORK/bin/F16.bin" ] || "${TD[@]}" export --target whisper.cpp --model "$MODEL" --type f16 \
    -o "$WORK/bin/F16.bin" --quiet

# The primary set: test utterances 0..599; the secondary: 200..599 (the first 200 are rounds 1-2's test sentences).
python - "$SYNTH" <<'PY'
import sys
synth = sys.argv[1]
lines = open(f"{synth}/test.jsonl", encoding="utf-8").read().splitlines()
assert len(lines) == 800, len(lines)
open(f"{synth}/test600.jsonl", "w", encoding="utf-8").write("\n".join(lines[:600]) + "\n")
open(f"{synth}/test-new400.jsonl", "w", encoding="utf-8").write("\n".join(lines[200:600]) + "\n")
PY

models=()
for label in F16 RTN IMATRIX GPTQ TARQ; do
  models+=(--model "$label=$WORK/bin/$label.bin")
done
# The decoded words are cached per utterance id (hypotheses/LABEL__BACKEND__SET.jsonl): the secondary set, a subset of
# the primary, starts from the primary's; only its teacher-forced figures (scored in packed windows) are computed anew.
for data in test600 test-new400; do
  out="$WORK/eval-$data"
  if [ "$data" = test-new400 ]; then
    mkdir -p "$out/hypotheses"
    for f in "$WORK"/eval-test600/hypotheses/*__whisper.cpp__test600.jsonl; do
      g="$out/hypotheses/$(basename "$f" __test600.jsonl)__test-new400.jsonl"
      [ -f "$g" ] || cp "$f" "$g"
    done
  fi
  "${TD[@]}" eval --data "$data=$SYNTH/$data.jsonl" --tokenizer "$MODEL" --backend whisper.cpp "${models[@]}" \
      --reference F16 --teacher-forced --compare TARQ:RTN --compare TARQ:IMATRIX --compare TARQ:GPTQ \
      --compare GPTQ:RTN --compare GPTQ:IMATRIX --focus TARQ --threads 1 --jobs 2 --resamples 2000 --out "$out" --quiet
  mkdir -p results/rarewords/round3/"$data"
  cp "$out/report.md" "$out/report.json" results/rarewords/round3/"$data"/
done
python results/rarewords/tracking.py results/rarewords/round3/test600/report.json results/rarewords/round3/test600 \
    --title "Round 3 test split (600 utt., unseen voice), Whisper base, whisper.cpp Q4_0"
python results/rarewords/power.py results/rarewords/round3/test600/report.json --out results/rarewords/round3/test600/power.md
