#!/usr/bin/env bash
# Item 6 for tiny.en's Q4_0, on the DEV split only: which half of TARQ costs it against GPTQ -- rareBAL alone
# (`--method rarebal`), the residual correction alone (`--method residual`), both (`tarq`, the sweep's file) -- with
# GPTQ's and ggml's files from the sweep beside them. Calibrated as the sweep calibrates (the same 128 utterances,
# seed 0, one thread); decoded as whisper-cli decodes, 1 thread, on the 40 dev utterances (the calibration's voices,
# sentences no calibration utterance has). Run after the tiny.en sweep and report.sh (its files), from the
# repository root.
set -euo pipefail
R=runs/cli-study-tiny-ablation S=runs/cli-study-tiny-files
export OMP_NUM_THREADS=1
for method in rarebal residual; do
  [[ -f $R/$method.verified ]] && continue
  tarq-deploy quantize --model packaged:tiny.en --method $method --target whisper.cpp --type q4_0 \
      --calib corpora/synth/calib.jsonl --n-calib 128 --seed 0 --out $R/ck-$method
  tarq-deploy export --target whisper.cpp $R/ck-$method -o $R/$method-q4_0.bin --quiet
  tarq-deploy verify $R/$method-q4_0.bin --against $R/ck-$method && touch $R/$method.verified
done
tarq-deploy eval --decode cli --data dev=corpora/synth/eval.jsonl \
    --model f16=$S/f16.bin --model ggml-q4_0=$S/ggml-q4_0.bin --model gptq-q4_0=$S/gptq-q4_0.bin \
    --model tarq-q4_0=$S/tarq-q4_0.bin --model rarebal-q4_0=$R/rarebal-q4_0.bin --model residual-q4_0=$R/residual-q4_0.bin \
    --compare tarq-q4_0:gptq-q4_0 --compare rarebal-q4_0:gptq-q4_0 --compare residual-q4_0:gptq-q4_0 \
    --compare tarq-q4_0:ggml-q4_0 --compare gptq-q4_0:ggml-q4_0 --reference f16 \
    --threads 1 --jobs 2 --resamples 2000 --out $R/dev-cli --quiet
