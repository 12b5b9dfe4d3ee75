#!/usr/bin/env bash
# Why ggml's IQ4_XS decodes rare words better than TARQ's although its rare KLD is a third higher (issue 38 item 3;
# results/frontier/README.md, "IQ4_XS"). The two files and F16, decoded on the whole held-out test split by
# whisper.cpp AND by PyTorch from the same .bin (greedy both), and scored teacher-forced against F16 in PyTorch.
# If the gap is the runtime's arithmetic, PyTorch's decode will not show it; if it is greedy decoding's sensitivity
# to a few near-tie tokens, both will, and the per-utterance texts say where. From the repository root, after
#   tarq-deploy corpus synth --out corpora/synth --n 200 --n-calib 128 --n-test 200 --seed 0
set -eu
W=${W:-runs/iq4_xs}
T="tarq-deploy"
mkdir -p "$W"
$T quantize --model packaged:base --method tarq --target whisper.cpp --type iq4_xs --calib corpora/synth/calib.jsonl \
    --n-calib 128 --seed 0 --out "$W/tarq-iq4_xs"
$T quantize --model packaged:base --method ggml --target whisper.cpp --type iq4_xs --out "$W/ggml-iq4_xs"
for m in tarq ggml; do
  $T export --target whisper.cpp "$W/$m-iq4_xs" -o "$W/$m-iq4_xs.bin" --quiet
  $T verify "$W/$m-iq4_xs.bin" --against "$W/$m-iq4_xs"
done
$T export --target whisper.cpp --model packaged:base --type f16 -o "$W/f16.bin" --quiet
models=()
for backend in whisper.cpp torch; do
  for m in F16=f16 ggml=ggml-iq4_xs tarq=tarq-iq4_xs; do
    models+=(--model "${m%%=*}=$W/${m#*=}.bin" --backend "$backend")
  done
done
$T eval --data test=corpora/synth/test.jsonl --tokenizer packaged:base "${models[@]}" --reference F16 \
    --teacher-forced --compare tarq:ggml --threads 1 --jobs 2 --resamples 2000 -o "$W/eval" --quiet
