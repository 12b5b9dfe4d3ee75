#!/bin/bash
# Issue 38's held-out comparison: TARQ's grid files of Whisper base against what whisper.cpp publishes (ggml Q5_0)
# and Q4_0, decoded by stock whisper.cpp on the test split (sentences of neither other split, the voice kal, which
# calibration and dev never hear). Run from the repository root after `make install`; the TARQ checkpoints are
# results/rotation/run.sh's with --rotate heads (auto's choice for IQ3_S, IQ3_XXS, IQ2_S; Q3_K's as made then). W as there.
set -eu
W=${W:-/tmp/rotation}
H=$W/heldout
T=".venv/bin/tarq-deploy"
mkdir -p "$H"
$T export --model packaged:base --type f16 -o "$H/f16.bin"
for t in q5_0 q4_0; do $T export --model packaged:base --baseline ggml --type $t -o "$H/ggml-$t.bin"; done
for c in iq3_s iq3_xxs q3_k iq2_s; do $T export "$W/ck/tarq-$c-heads" -o "$H/tarq-$c-heads.bin"; done
$T eval --data "test=$W/synth/test.jsonl" --limit 100 --backend whisper.cpp --tokenizer packaged:base \
  --model "F16=$H/f16.bin" --model "ggml-Q5_0=$H/ggml-q5_0.bin" --model "ggml-Q4_0=$H/ggml-q4_0.bin" \
  --model "TARQ-IQ3_S=$H/tarq-iq3_s-heads.bin" --model "TARQ-Q3_K=$H/tarq-q3_k-heads.bin" \
  --model "TARQ-IQ3_XXS=$H/tarq-iq3_xxs-heads.bin" --model "TARQ-IQ2_S=$H/tarq-iq2_s-heads.bin" \
  --reference F16 --teacher-forced --threads 1 --jobs 2 --resamples 2000 \
  --compare TARQ-IQ3_S:ggml-Q5_0 --compare TARQ-IQ3_S:ggml-Q4_0 --compare TARQ-Q3_K:ggml-Q5_0 \
  --compare TARQ-Q3_K:ggml-Q4_0 --compare TARQ-IQ3_XXS:ggml-Q4_0 --compare TARQ-IQ2_S:ggml-Q4_0 -o "$H/eval"
# eval's paired table has no capped rare-WER column; this adds it (the same bootstrap: 2,000 resamples, seed 0)
.venv/bin/python results/grid/capped_rare.py "$H/eval/utterances.jsonl" TARQ-IQ3_S:ggml-Q5_0 TARQ-IQ3_S:ggml-Q4_0 \
  TARQ-Q3_K:ggml-Q5_0 TARQ-Q3_K:ggml-Q4_0 TARQ-IQ3_XXS:ggml-Q4_0 TARQ-IQ2_S:ggml-Q4_0 ggml-Q5_0:F16 ggml-Q4_0:F16

# Ablation of the 2-bit failure (dev split, teacher-forced): TARQ IQ2_S with one part of the model kept at Q4_0, a
# per-tensor mix (transcribe.cpp's GGUF holds one; whisper.cpp's .bin cannot), against the uniform IQ2_S.
for spec in "head:proj_out=q4_0" "encoder:model\.encoder=q4_0" "decoder:model\.decoder\.layers=q4_0"; do
  name=${spec%%:*} pattern=${spec#*:}
  $T quantize --model packaged:base --calib "$W/synth/calib.jsonl" --n-calib 128 --method tarq --type iq2_s \
    --target transcribe.cpp --tensor-type "$pattern" --out "$W/ablation/tarq-iq2_s-$name-q4_0"
done
args=(--data "dev=$W/synth/eval.jsonl" --reference F16 --teacher-forced-only --model F16=packaged:base --backend torch
      --resamples 2000 --threads 2 --model "IQ2_S=$W/ck/tarq-iq2_s-heads")
for ck in "$W"/ablation/*/; do n=$(basename "$ck"); args+=(--model "$n=$ck" --compare "$n:IQ2_S"); done
$T eval "${args[@]}" -o "$W/ablation/eval"
