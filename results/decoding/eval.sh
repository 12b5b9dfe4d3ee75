#!/usr/bin/env bash
# The study's evaluations beside the sweep (results/decoding/sweep-cli.toml, run first into runs/decoding):
# 1. greedy: the research protocol on the test split and the non-speech clips, for F16 and ggml / TARQ at Q4_0 and
#    Q3_K (the files the sweep exported, linked into runs/files);
# 2. cli: the same seven files as the sweep decoded them, in one report with the cross-type pairs (TARQ Q3_K vs ggml
#    Q4_0) the sweep report does not make: the sweep's hypothesis caches are copied in, so nothing is decoded again.
set -euo pipefail
F=runs/files
models=(--model "f16=$F/base---f16-f16.bin" --model "ggml-q4_0=$F/base---ggml-q4_0.bin"
        --model "tarq-q4_0=$F/base-synth-tarq-q4_0.bin" --model "ggml-q3_k=$F/base---ggml-q3_k.bin"
        --model "tarq-q3_k=$F/base-synth-tarq-q3_k.bin")
pairs=(--compare tarq-q4_0:ggml-q4_0 --compare tarq-q3_k:ggml-q3_k --compare tarq-q3_k:ggml-q4_0)
case "${1:-greedy}" in
greedy)
  tarq-deploy eval --decode greedy --data test=corpora/synth/test.jsonl --nonspeech corpora/nonspeech/nonspeech.jsonl \
      "${models[@]}" "${pairs[@]}" --reference f16 --threads 1 --jobs 1 --resamples 2000 --out runs/decoding-greedy --quiet ;;
cli)
  mkdir -p runs/decoding-cli/hypotheses
  for f in runs/decoding/steps/eval/*/hypotheses/*.jsonl; do
    # the sweep labels a run by its cell (base/-/ggml/q4_0); this report by a short name: the same cache identity
    name=$(basename "$f" | sed -e 's/^base_-_f16_f16__/f16__/' -e 's/^base_-_ggml_\(q[0-9a-z_]*\)__whisper/ggml-\1__whisper/' \
                               -e 's/^base_synth_tarq_\(q[0-9a-z_]*\)__whisper/tarq-\1__whisper/' \
                               -e 's/^base_synth_gptq_\(q[0-9a-z_]*\)__whisper/gptq-\1__whisper/')
    cp "$f" "runs/decoding-cli/hypotheses/$name"
  done
  tarq-deploy eval --decode cli --data test=corpora/synth/test.jsonl --data long=corpora/long/long.jsonl \
      --nonspeech corpora/nonspeech/nonspeech.jsonl "${models[@]}" \
      --model "gptq-q4_0=$F/base-synth-gptq-q4_0.bin" --model "gptq-q3_k=$F/base-synth-gptq-q3_k.bin" \
      "${pairs[@]}" --compare tarq-q4_0:gptq-q4_0 --compare tarq-q3_k:gptq-q3_k \
      --reference f16 --threads 1 --jobs 1 --resamples 2000 --out runs/decoding-cli --quiet ;;
esac
