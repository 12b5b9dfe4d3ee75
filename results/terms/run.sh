#!/usr/bin/env bash
# Issue 63's study: a user's term list against the Zipf tail, GPTQ and ggml's rounding, on Whisper base.
#   terms:  results/terms/domain-terms.txt (WordNet 3.0's medicine / law / biology topic domains, Zipf < 4;
#           results/terms/make_terms.py)
#   corpus: `corpus synth --terms`: sentences of the Debian text sources that hold a term; 25 % of the occurring
#           terms kept out of calibration (terms-unseen.txt); test split in the voice kal, which calibration never hears
#   files:  F16; at Q4_0 and Q3_K: ggml's rounding, GPTQ, TARQ with the Zipf tail (its default), TARQ with the term
#           list (--terms, tail "both": its default with a list) -- all from the same 128 calibration utterances
#   decode: whisper.cpp (pywhispercpp 1.5.1), 1 thread, whisper-cli's defaults (cli), and greedy beside it
#   eval:   term recall / term-WER with the whole list, the terms calibration held (seen) and those it never held
#           (unseen), WER / rare-WER (capped too), paired 95 % bootstrap intervals (2000 resamples)
# Stages: corpus | quantize | dev (the --tail default, on the dev split) | eval PROFILE (cli or greedy) | kld (the
# teacher-forced figures at term positions). From the repository root, with .venv active.
set -euo pipefail
C=corpora/terms R=runs/terms F=runs/terms/files T=results/terms/domain-terms.txt
stage=${1:-all}

if [[ $stage == corpus || $stage == all ]]; then
  tarq-deploy corpus synth -o $C --terms $T --n 40 --n-test 120 --n-calib 128 --voices slt,joe --test-voices kal \
      --sources web,devil,wordnet --seed 0
fi

if [[ $stage == quantize || $stage == all ]]; then
  mkdir -p $F
  [[ -f $F/f16.bin ]] || tarq-deploy export --model packaged:base --type f16 -o $F/f16.bin --quiet
  for type in q4_0 q3_k; do
    declare -A extra=([ggml]="--method ggml" [gptq]="--method gptq --calib $C/calib.jsonl"
                      [tarq]="--method tarq --calib $C/calib.jsonl"
                      [tarq-terms]="--method tarq --calib $C/calib.jsonl --terms $T")
    for name in ggml gptq tarq tarq-terms; do
      ck=$R/ck/$name-$type
      [[ -f $F/$name-$type.bin ]] && continue
      tarq-deploy quantize --model packaged:base --type $type ${extra[$name]} --seed 0 --out $ck
      tarq-deploy export $ck --target whisper.cpp -o $F/$name-$type.bin --quiet
      tarq-deploy verify --checkpoint $ck $F/$name-$type.bin
    done
  done
fi

if [[ $stage == dev || $stage == all ]]; then
  # --tail's default with a term list, chosen here on the dev split (eval.jsonl: voices slt and joe, sentences of
  # neither other split) under cli: terms alone against terms + every other Zipf-rare word ("both")
  for type in q4_0 q3_k; do
    ck=$R/ck/tarq-termsonly-$type
    if [[ ! -f $F/tarq-termsonly-$type.bin ]]; then
      tarq-deploy quantize --model packaged:base --type $type --method tarq --calib $C/calib.jsonl --terms $T \
          --tail terms --seed 0 --out $ck
      tarq-deploy export $ck --target whisper.cpp -o $F/tarq-termsonly-$type.bin --quiet
      tarq-deploy verify --checkpoint $ck $F/tarq-termsonly-$type.bin
    fi
  done
  tarq-deploy eval --decode cli --data dev=$C/eval.jsonl --model f16=$F/f16.bin \
      --model tarq-terms-q4_0=$F/tarq-terms-q4_0.bin --model tarq-termsonly-q4_0=$F/tarq-termsonly-q4_0.bin \
      --model tarq-terms-q3_k=$F/tarq-terms-q3_k.bin --model tarq-termsonly-q3_k=$F/tarq-termsonly-q3_k.bin \
      --compare tarq-termsonly-q4_0:tarq-terms-q4_0 --compare tarq-termsonly-q3_k:tarq-terms-q3_k --reference f16 \
      --terms $T --threads 1 --jobs 2 --resamples 2000 --out $R/dev-cli --quiet
fi

if [[ $stage == eval || $stage == all ]]; then
  profile=${2:-cli}
  models=(--model f16=$F/f16.bin)
  for type in q4_0 q3_k; do
    for name in ggml gptq tarq tarq-terms; do models+=(--model $name-$type=$F/$name-$type.bin); done
  done
  pairs=()
  for type in q4_0 q3_k; do
    pairs+=(--compare tarq-terms-$type:gptq-$type --compare tarq-terms-$type:ggml-$type
            --compare tarq-terms-$type:tarq-$type --compare tarq-$type:gptq-$type)
  done
  out=$R/eval-$profile
  for list in all seen unseen; do
    file=$T; [[ $list == all ]] || file=$C/terms-$list.txt
    dir=$out-$list
    if [[ $list != all ]]; then mkdir -p $dir; cp -r $out-all/hypotheses $dir/; fi  # decoded once: cached
    tarq-deploy eval --decode $profile --data test=$C/test.jsonl "${models[@]}" "${pairs[@]}" --reference f16 \
        --terms $file --threads 1 --jobs 2 --resamples 2000 --out $dir --quiet
  done
fi

if [[ $stage == kld || $stage == all ]]; then
  # teacher-forced figures at the term positions of the whole list (KLD, dNLL, top-1 against F16; PyTorch loads
  # each file's exact values; no decoding)
  models=(--model f16=$F/f16.bin)
  for type in q4_0 q3_k; do
    for name in ggml gptq tarq tarq-terms; do models+=(--model $name-$type=$F/$name-$type.bin); done
  done
  tarq-deploy eval --teacher-forced-only --data test=$C/test.jsonl --backend torch "${models[@]}" \
      --tokenizer packaged:base --reference f16 --terms $T --compare tarq-terms-q4_0:gptq-q4_0 \
      --compare tarq-terms-q3_k:gptq-q3_k --compare tarq-terms-q4_0:ggml-q4_0 --compare tarq-terms-q4_0:tarq-q4_0 \
      --compare tarq-terms-q3_k:tarq-q3_k --threads 2 --resamples 2000 --out $R/kld-terms --quiet
fi
