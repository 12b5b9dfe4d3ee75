#!/usr/bin/env bash
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
cd /work/main
W=/tmp/pitfalls
CAL=/tmp/evalwork/corpora/synth/calib.jsonl
TD=(python -m tarq_deploy.cli)
[ -d "$W/ck-gptq-mu0" ] || "${TD[@]}" quantize --model packaged:tiny.en --calib "$CAL" --n-calib 128 --method gptq --head-identity-weight 0 --out "$W/ck-gptq-mu0"
"${TD[@]}" export --target whisper.cpp "$W/ck-gptq-mu0" -o "$W/gptq-mu0.bin" --quiet
echo QUANTIZED
"${TD[@]}" eval --data "synth=/tmp/evalwork/corpora/synth/eval.jsonl" \
  --model "F16=$W/f16.bin" --model "ggml-RTN=$W/ggml-rtn.bin" --model "GPTQ mu0=$W/gptq-mu0.bin" \
  --model "GPTQ mu1=$W/gptq-mu1.bin" --model "rareBAL mu1=$W/rarebal-mu1.bin" --model "TARQ mu0=$W/tarq-mu0.bin" \
  --model "TARQ mu1=$W/tarq-mu1.bin" --threads 1 --jobs 2 --focus "TARQ mu1" \
  --compare "TARQ mu1:GPTQ mu1" --compare "rareBAL mu1:GPTQ mu1" --compare "TARQ mu1:TARQ mu0" --compare "GPTQ mu1:GPTQ mu0" \
  --out "$W/eval" --quiet
echo EVALUATED
