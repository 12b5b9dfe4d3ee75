#!/usr/bin/env bash
# Issue 61, item 6: calibrating Whisper's decoder in the token shape whisper-cli decodes in (--decoder-shape).
#   corpus:   the decoding study's corpus (results/decoding: corpus synth seed 0, 128 calibration utterances in slt/joe,
#             120 test utterances in kal) and a dev pool (corpus synth seed 1, slt/joe) with every sentence of the
#             study's calibration and test splits removed; 12 dev recordings of 2-3 min are made from the pool
#   files:    Whisper base, F16; at Q4_0 and Q3_K: ggml's rounding, TARQ with --decoder-shape plain (today), cli, both
#   dev:      teacher-forced KLD in three token shapes on the dev split (probe.py) and the 12 dev recordings decoded
#             whole under whisper-cli's defaults: the shape is chosen here, never on the test split
#   test:     the chosen shape against plain and ggml on the test recordings, non-speech clips and test split (cli)
# Stages: corpus | quantize | probe | dev | test cli | devnonspeech (made after the test: see the README). From the
# repository root, with .venv active.
set -euo pipefail
C=corpora/synth P=corpora/devpool R=runs/cliform F=runs/cliform/files
stage=${1:-all}

if [[ $stage == corpus || $stage == all ]]; then
  [[ -f $C/calib.jsonl ]] || tarq-deploy corpus synth --out $C --n 40 --n-test 120 --n-calib 128 --voices slt,joe \
      --test-voices kal --seed 0
  [[ -f $P/eval.jsonl ]] || tarq-deploy corpus synth --out $P --n 240 --n-calib 1 --voices slt,joe --seed 1
  python results/cliform/disjoint.py $P/eval.jsonl $C/calib.jsonl $C/test.jsonl > $P/dev-pool.jsonl
  [[ -f corpora/devlong/long.jsonl ]] || tarq-deploy corpus long --data $P/dev-pool.jsonl -o corpora/devlong \
      --minutes 2,3 --n 12 --seed 1
  [[ -f corpora/long/long.jsonl ]] || tarq-deploy corpus long --data $C/test.jsonl -o corpora/long --minutes 3,5 \
      --n 3 --seed 0
  [[ -f corpora/nonspeech/nonspeech.jsonl ]] || tarq-deploy corpus nonspeech -o corpora/nonspeech --seconds 30 \
      --per-kind 1 --seed 0 --babble-from $C/eval.jsonl
fi

if [[ $stage == quantize || $stage == all ]]; then
  mkdir -p $F
  [[ -f $F/f16.bin ]] || tarq-deploy export --model packaged:base --type f16 -o $F/f16.bin --quiet
  for type in q4_0 q3_k; do
    for name in ggml tarq-plain tarq-cli tarq-both ${EXTRA:-}; do
      [[ -f $F/$name-$type.bin ]] && continue
      case $name in
        ggml) args="--method ggml" ;;
        tarq-*) args="--method tarq --calib $C/calib.jsonl --decoder-shape ${name#tarq-}" ;;
        gptq-*) args="--method gptq --calib $C/calib.jsonl --decoder-shape ${name#gptq-}" ;;
      esac
      tarq-deploy quantize --model packaged:base --type $type $args --seed 0 --out $R/ck/$name-$type
      tarq-deploy export $R/ck/$name-$type --target whisper.cpp -o $F/$name-$type.bin --quiet
      tarq-deploy verify --checkpoint $R/ck/$name-$type $F/$name-$type.bin
    done
  done
fi

models() {  # --model flags of F16 and every file of the given names at both types
  echo --model f16=$F/f16.bin
  for type in q4_0 q3_k; do for name in "$@"; do echo --model $name-$type=$F/$name-$type.bin; done; done
}

if [[ $stage == probe || $stage == all ]]; then
  files=(f16=$F/f16.bin)
  for type in q4_0 q3_k; do for name in ggml tarq-plain tarq-cli tarq-both; do files+=($name-$type=$F/$name-$type.bin); done; done
  python results/cliform/probe.py --data $C/eval.jsonl --tokenizer packaged:base "${files[@]}" > $R/probe-dev.json
fi

if [[ $stage == dev || $stage == all ]]; then
  # "both" was dropped on the dev probe (worse than cli at every whisper-cli-shape figure, the same cost in plain)
  # ggml's Q3_K left out to save 20 minutes of decoding: the choice is cli against plain
  pairs=(--compare tarq-plain-q4_0:ggml-q4_0 --compare tarq-cli-q4_0:ggml-q4_0)
  for type in q4_0 q3_k; do pairs+=(--compare tarq-cli-$type:tarq-plain-$type); done
  tarq-deploy eval --decode cli --data devlong=corpora/devlong/long.jsonl --model ggml-q4_0=$F/ggml-q4_0.bin \
      $(models tarq-plain tarq-cli) \
      "${pairs[@]}" --reference f16 --threads 1 --jobs 2 --resamples 2000 --out $R/dev-long --quiet
fi

if [[ $stage == test || $stage == all ]]; then
  # the chosen shape (argument 2) against plain and ggml's rounding: first the long recordings and the non-speech
  # clips (where results/decoding saw the calibrated files loop), then the 120 test utterances
  chosen=${2:?the shape chosen on the dev split}
  pairs=()
  for type in q4_0 q3_k; do
    pairs+=(--compare tarq-$chosen-$type:tarq-plain-$type --compare tarq-$chosen-$type:ggml-$type
            --compare tarq-plain-$type:ggml-$type)
  done
  pairs+=(--compare tarq-$chosen-q3_k:ggml-q4_0)
  tarq-deploy eval --decode cli --data long=corpora/long/long.jsonl --nonspeech corpora/nonspeech/nonspeech.jsonl \
      $(models ggml tarq-plain tarq-$chosen) "${pairs[@]}" --reference f16 --threads 1 --jobs 2 --resamples 2000 \
      --out $R/test-long-cli --quiet
  tarq-deploy eval --decode cli --data test=$C/test.jsonl $(models ggml tarq-plain tarq-$chosen) "${pairs[@]}" \
      --reference f16 --threads 1 --jobs 2 --resamples 2000 --out $R/test-cli --quiet
fi

if [[ $stage == devnonspeech ]]; then
  # measured after the test had been read, to fix the dev protocol (not the default): six dev non-speech clips
  [[ -f corpora/devnonspeech/nonspeech.jsonl ]] || tarq-deploy corpus nonspeech -o corpora/devnonspeech --seconds 30 \
      --per-kind 1 --seed 1 --babble-from $P/dev-pool.jsonl
  head -2 $C/eval.jsonl > $C/eval-2.jsonl  # eval needs a --data; two dev utterances
  tarq-deploy eval --decode cli --data dev2=$C/eval-2.jsonl --nonspeech corpora/devnonspeech/nonspeech.jsonl \
      --model f16=$F/f16.bin $(for type in q4_0 q3_k; do for name in tarq-plain tarq-cli; do
        echo --model $name-$type=$F/$name-$type.bin; done; done) --reference f16 --threads 1 --jobs 1 \
      --resamples 2000 --out $R/dev-nonspeech --quiet
fi
