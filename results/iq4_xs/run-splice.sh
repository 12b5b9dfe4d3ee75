#!/usr/bin/env bash
# The causal check, after run.sh: ggml's and TARQ's IQ4_XS files with their tied token embedding / head exchanged
# (splice.py: the codes copied, nothing re-quantized; still one-type IQ4_XS files that stock whisper.cpp loads),
# decoded by whisper.cpp and scored teacher-forced beside the three files of run.sh. eval finds those three's
# hypotheses and figures in its cache (same bytes, same settings) and decodes only the two new files.
set -eu
W=${W:-runs/iq4_xs}
T="tarq-deploy"
P=${P:-.venv/bin/python}
for spec in tarq-body-ggml-head:tarq:ggml ggml-body-tarq-head:ggml:tarq; do
  IFS=: read -r name body donor <<< "$spec"
  $P results/iq4_xs/splice.py "$W/$body-iq4_xs" "$W/$donor-iq4_xs" --take '^proj_out\.' -o "$W/$name"
  $T export --target whisper.cpp "$W/$name" -o "$W/$name.bin" --quiet
  $T verify "$W/$name.bin" --against "$W/$name"
done
models=()
for backend in whisper.cpp torch; do
  for m in F16=f16 ggml=ggml-iq4_xs tarq=tarq-iq4_xs; do
    models+=(--model "${m%%=*}=$W/${m#*=}.bin" --backend "$backend")
  done
done
for m in tarq-body-ggml-head ggml-body-tarq-head; do models+=(--model "$m=$W/$m.bin" --backend whisper.cpp); done
$T eval --data test=corpora/synth/test.jsonl --tokenizer packaged:base "${models[@]}" --reference F16 \
    --teacher-forced --compare tarq:ggml --compare tarq-body-ggml-head:tarq --compare ggml-body-tarq-head:ggml \
    --compare tarq-body-ggml-head:ggml --threads 1 --jobs 2 --resamples 2000 -o "$W/eval" --quiet
