#!/usr/bin/env bash
# The final rare-word table (issue 18): tiny.en and base; F16, ggml RTN, imatrix, GPTQ and TARQ (defaults), all as
# whisper.cpp Q4_0 files through whisper.cpp, on the held-out TEST split (sentences no other split has, spoken by a
# voice -- festival KAL -- that neither calibration nor the dev split hears). Run from the repository root; corpora,
# checkpoints and files go to $WORK (default /tmp/tarq-rarewords), the reports to results/rarewords/. Resumable:
# what exists is reused.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
WORK=${WORK:-/tmp/tarq-rarewords}
TD=(python -m tarq_deploy.cli)

"${TD[@]}" corpus synth --out "$WORK/synth" --n 200 --n-test 200 --n-calib 512 --voices slt,joe --test-voices kal --seed 0

for size in tiny.en base; do
  model=packaged:$size
  [ -f "$WORK/$size-f16.bin" ] || "${TD[@]}" export --target whisper.cpp --model "$model" --type f16 -o "$WORK/$size-f16.bin" --quiet
  for method in rtn imatrix gptq tarq; do  # every method with its defaults (tarq-deploy quantize --help)
    ckpt="$WORK/$size-$method"
    [ -f "$ckpt/manifest.json" ] || "${TD[@]}" quantize --model "$model" --calib "$WORK/synth/calib.jsonl" \
        --method "$method" --out "$ckpt"
    [ -f "$WORK/$size-$method-q4_0.bin" ] || "${TD[@]}" export --target whisper.cpp "$ckpt" -o "$WORK/$size-$method-q4_0.bin" --quiet
    "${TD[@]}" verify "$WORK/$size-$method-q4_0.bin" --against "$ckpt" > /dev/null
  done
  "${TD[@]}" eval --data test="$WORK/synth/test.jsonl" --tokenizer "$model" \
      --model "F16=$WORK/$size-f16.bin" --model "RTN=$WORK/$size-rtn-q4_0.bin" \
      --model "IMATRIX=$WORK/$size-imatrix-q4_0.bin" --model "GPTQ=$WORK/$size-gptq-q4_0.bin" \
      --model "TARQ=$WORK/$size-tarq-q4_0.bin" --backend whisper.cpp \
      --reference F16 --teacher-forced --compare TARQ:RTN --compare TARQ:IMATRIX --compare TARQ:GPTQ \
      --focus TARQ --threads 1 --jobs 2 --resamples 2000 --out "$WORK/eval-$size" --quiet
  mkdir -p results/rarewords/"$size"
  cp "$WORK/eval-$size/report.md" "$WORK/eval-$size/report.json" results/rarewords/"$size"/
done
for size in tiny.en base; do
  python results/rarewords/tracking.py results/rarewords/$size/report.json results/rarewords/$size \
      --title "Test split (unseen voice), Whisper $size, whisper.cpp Q4_0: teacher-forced figures vs rare-WER"
done
