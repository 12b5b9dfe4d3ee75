#!/usr/bin/env bash
# TARQ's IQ3_S against ggml's Q4_0 (the 4-bit file people ship), paired, under cli on the test split and the
# non-speech clips: ggml's Q4_0 made as the base study's sweep makes it (`--method ggml`), decoded here; F16's and
# TARQ's IQ3_S hypotheses come from the IQ3_S sweep's caches (report.sh's output folder), nothing decoded again for
# them. Run after the IQ3_S sweep and `SWEEP=runs/cli-study-iq3_s results/cli-study/report.sh cli`, from the
# repository root.
set -euo pipefail
R=runs/cli-study-iq3_s-versus-q4_0 F=runs/cli-study-iq3_s-files
mkdir -p $R/hypotheses
export OMP_NUM_THREADS=1
if [[ ! -f $R/ggml-q4_0.verified ]]; then
  tarq-deploy quantize --model packaged:base --method ggml --target whisper.cpp --type q4_0 --seed 0 --out $R/ck-ggml-q4_0
  tarq-deploy export --target whisper.cpp $R/ck-ggml-q4_0 -o $R/ggml-q4_0.bin --quiet
  tarq-deploy verify $R/ggml-q4_0.bin --against $R/ck-ggml-q4_0 && touch $R/ggml-q4_0.verified
fi
cp runs/cli-study-iq3_s-cli/hypotheses/{f16,tarq-iq3_s}__* $R/hypotheses/
tarq-deploy eval --decode cli --data test=corpora/synth/test.jsonl --nonspeech corpora/nonspeech/nonspeech.jsonl \
    --model f16=$F/f16.bin --model tarq-iq3_s=$F/tarq-iq3_s.bin --model ggml-q4_0=$R/ggml-q4_0.bin \
    --compare tarq-iq3_s:ggml-q4_0 --reference f16 --threads 1 --jobs 2 --resamples 2000 --out $R --quiet
