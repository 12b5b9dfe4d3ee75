#!/usr/bin/env bash
# How much do decoded rare-WER differences move when only the calibration draw changes? (issue 18, after round 2)
# GPTQ and TARQ on base, defaults (128 utterances), with calibration seeds 1 and 2 beside round 2's seed 0: the seed
# picks which 128 of calib.jsonl's 512 utterances calibrate. Each checkpoint goes to whisper.cpp Q4_0 and is scored on
# the TEST split like run_final_round2.sh (run that first: this script reuses its $WORK, checkpoints and hypothesis
# cache, so only the new models are decoded). The report goes to results/rarewords/base-seeds/.
source "$(dirname "$0")/checkpoints.sh"

for seed in 1 2; do
  checkpoint "GPTQ-s$seed" gptq --seed "$seed"
  checkpoint "TARQ-s$seed" tarq --seed "$seed"
done

out="$WORK/eval-test-seeds"
mkdir -p "$out"
cp -rn "$WORK/eval-test-round2/hypotheses" "$WORK/eval-test-round2/teacher-forced" "$out/" 2>/dev/null || true
models=()
for label in F16 GPTQ TARQ GPTQ-s1 TARQ-s1 GPTQ-s2 TARQ-s2; do
  models+=(--model "$label=$WORK/bin/$label.bin")
done
"${TD[@]}" eval --data test="$SYNTH/test.jsonl" --tokenizer "$MODEL" --backend whisper.cpp "${models[@]}" \
    --reference F16 --teacher-forced --compare TARQ:GPTQ --compare TARQ-s1:GPTQ-s1 --compare TARQ-s2:GPTQ-s2 \
    --compare GPTQ-s1:GPTQ --compare GPTQ-s2:GPTQ --compare TARQ-s1:TARQ --compare TARQ-s2:TARQ \
    --focus TARQ --threads 1 --jobs 2 --resamples 2000 --out "$out" --quiet
mkdir -p results/rarewords/base-seeds
cp "$out/report.md" "$out/report.json" results/rarewords/base-seeds/
