#!/usr/bin/env bash
# The size / quality table of issue 16: Whisper base in every whisper.cpp type people ship -- F16, and Q4_0, Q4_1,
# Q5_0, Q5_1, Q8_0, Q4_K, Q5_K each by ggml's own quantizer (what whisper.cpp's quantize tool writes), by ggml with
# an importance matrix (llama.cpp / CrispASR imatrix, 128 calibration utterances) and by TARQ (128 utterances, every
# option at its default). Every checkpoint is exported to a whisper.cpp file, verified bit-exact against it, decoded
# by whisper.cpp (pywhispercpp, 1 thread, greedy) on the held-out TEST split (unseen sentences, unseen voice) and
# scored teacher-forced against F16 in PyTorch. Nothing here was tuned on the test split: the TARQ defaults come from
# the dev split (results/rarewords/).
#
#   bash results/types/run_types.sh          # from the repository root; WORK (default /tmp/r) holds the corpus
#
# The corpus is results/rarewords/run_ablation_data.sh's ($WORK/synth). Resumable: what exists is reused. Writes
# results/types/{report.md,report.json,table.md,size_quality.png}. LIMIT (default 200, the whole test split, as
# published) evaluates the first LIMIT test utterances: 22 models through whisper.cpp (base, 1 thread, ~2.7 s an
# utterance) and teacher-forced in PyTorch take about two hours for 200 on a 2-core machine, besides about two hours
# of calibration; LIMIT=60 gives a quick look.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
WORK=${WORK:-/tmp/r}
OUT=$WORK/types
TD=(python -m tarq_deploy.cli)
SYNTH="$WORK/synth"
MODEL=packaged:base
LIMIT=${LIMIT:-200}
TYPES=(q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k)
METHODS=(ggml imatrix tarq)
mkdir -p "$OUT/ck" "$OUT/bin"

for type in "${TYPES[@]}"; do
  for method in "${METHODS[@]}"; do
    label=$method-$type ckpt=$OUT/ck/$method-$type bin=$OUT/bin/$method-$type.bin
    calib=(); [ "$method" = ggml ] || calib=(--calib "$SYNTH/calib.jsonl")
    [ -f "$ckpt/manifest.json" ] || /usr/bin/time -f "$label calibration %e s" -a -o "$OUT/times.txt" \
        "${TD[@]}" quantize --model "$MODEL" --method "$method" --type "$type" "${calib[@]}" --out "$ckpt"
    [ -f "$bin" ] || "${TD[@]}" export --target whisper.cpp "$ckpt" -o "$bin" --quiet
    "${TD[@]}" verify "$bin" --against "$ckpt" > /dev/null
  done
done
[ -f "$OUT/bin/F16.bin" ] || "${TD[@]}" export --target whisper.cpp --model "$MODEL" --type f16 -o "$OUT/bin/F16.bin" --quiet

models=(--model "F16=$OUT/bin/F16.bin") compares=()
for type in "${TYPES[@]}"; do
  for method in "${METHODS[@]}"; do models+=(--model "$method-$type=$OUT/bin/$method-$type.bin"); done
  compares+=(--compare "tarq-$type:ggml-$type" --compare "tarq-$type:imatrix-$type")
done
"${TD[@]}" eval --data test="$SYNTH/test.jsonl" --tokenizer "$MODEL" --backend whisper.cpp "${models[@]}" \
    --reference F16 --teacher-forced "${compares[@]}" --limit "$LIMIT" --threads 1 --jobs 2 --resamples 2000 \
    --out "$OUT/eval" --quiet
cp "$OUT/eval/report.md" "$OUT/eval/report.json" results/types/
python results/types/table.py results/types/report.json "$OUT/bin" results/types
