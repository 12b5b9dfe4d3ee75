#!/usr/bin/env bash
# The test-split check of round 2's dev finding (issue 18): does TARQ calibrated on 512 utterances beat GPTQ on 512
# (and imatrix on 512, ggml's rounding, and both methods on 128) on the held-out TEST split -- unseen sentences, the
# unseen KAL voice -- through whisper.cpp? Whisper base, Q4_0 (group 32), every option at its default but --n-calib.
# Every checkpoint is exported to a whisper.cpp file, verified bit-exact, decoded by whisper.cpp (pywhispercpp, 1
# thread, greedy) and scored teacher-forced against F16 in PyTorch. Run from the repository root after
# run_ablation_data.sh (it shares $WORK, default /tmp/r, and reuses its checkpoints; missing ones are calibrated
# here). The report goes to results/rarewords/base-round2/. Resumable: what exists is reused.
source "$(dirname "$0")/checkpoints.sh"

checkpoint RTN rtn
checkpoint IMATRIX imatrix
checkpoint GPTQ gptq
checkpoint TARQ tarq
checkpoint IMATRIX-n512 imatrix --n-calib 512
checkpoint GPTQ-n512 gptq --n-calib 512
checkpoint TARQ-n512 tarq --n-calib 512
[ -f "$WORK/bin/F16.bin" ] || "${TD[@]}" export --target whisper.cpp --model "$MODEL" --type f16 \
    -o "$WORK/bin/F16.bin" --quiet

models=()
for label in F16 RTN IMATRIX GPTQ TARQ IMATRIX-n512 GPTQ-n512 TARQ-n512; do
  models+=(--model "$label=$WORK/bin/$label.bin")
done
"${TD[@]}" eval --data test="$SYNTH/test.jsonl" --tokenizer "$MODEL" --backend whisper.cpp "${models[@]}" \
    --reference F16 --teacher-forced --compare TARQ-n512:GPTQ-n512 --compare TARQ-n512:IMATRIX-n512 \
    --compare TARQ-n512:RTN --compare TARQ-n512:TARQ --compare GPTQ-n512:GPTQ --compare TARQ:GPTQ \
    --focus TARQ-n512 --threads 1 --jobs 2 --resamples 2000 --out "$WORK/eval-test-round2" --quiet
mkdir -p results/rarewords/base-round2
cp "$WORK/eval-test-round2/report.md" "$WORK/eval-test-round2/report.json" results/rarewords/base-round2/
python results/rarewords/tracking.py results/rarewords/base-round2/report.json results/rarewords/base-round2 \
    --title "Test split (unseen voice), Whisper base, whisper.cpp Q4_0, 128 and 512 calibration utterances"
