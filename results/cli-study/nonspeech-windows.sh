#!/usr/bin/env bash
# Issue 61 item 6, the next candidate: TARQ calibrated with non-speech windows (--nonspeech-share 0.25: six windows,
# one per kind, beside the 25 speech windows; 1 torch thread as the sweep calibrates), checked on DEV non-speech
# clips only so far (30 clips, 5 per kind, seed 11, babble from the dev pool) under cli, against the sweep's plain
# TARQ files and F16. Run after the cli sweep (its files), from the repository root.
set -euo pipefail
R=runs/nsw S=runs/cli-study-files
export OMP_NUM_THREADS=1
[[ -f corpora/devnonspeech5/nonspeech.jsonl ]] || tarq-deploy corpus nonspeech -o corpora/devnonspeech5 --seconds 30 \
    --per-kind 5 --seed 11 --babble-from corpora/devpool/dev-pool.jsonl
head -2 corpora/synth/eval.jsonl > corpora/synth/eval-2.jsonl  # eval needs a --data: two dev utterances
for type in q4_0 q3_k; do
  [[ -f $R/ns-$type.verified ]] && continue
  tarq-deploy quantize --model packaged:base --method tarq --target whisper.cpp --type $type \
      --calib corpora/synth/calib.jsonl --n-calib 128 --seed 0 --nonspeech-share 0.25 --out $R/ck-ns-$type
  tarq-deploy export $R/ck-ns-$type -o $R/ns-$type.bin --quiet
  tarq-deploy verify --checkpoint $R/ck-ns-$type $R/ns-$type.bin && touch $R/ns-$type.verified
done
tarq-deploy eval --decode cli --data dev2=corpora/synth/eval-2.jsonl --nonspeech corpora/devnonspeech5/nonspeech.jsonl \
    --model f16=$S/f16.bin --model plain-q4_0=$S/tarq-q4_0.bin --model plain-q3_k=$S/tarq-q3_k.bin \
    --model ns-q4_0=$R/ns-q4_0.bin --model ns-q3_k=$R/ns-q3_k.bin \
    --compare ns-q4_0:plain-q4_0 --compare ns-q3_k:plain-q3_k --reference f16 \
    --threads 1 --jobs 1 --resamples 2000 --out $R/dev-nonspeech5 --quiet
python results/cli-study/clip_bootstrap.py $R/dev-nonspeech5/report.json ns-q4_0:plain-q4_0 ns-q3_k:plain-q3_k
