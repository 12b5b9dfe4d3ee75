#!/usr/bin/env bash
# Issue-3 pitfall measurements on tiny.en: head metric weight mu, rareBAL alone, packing. Calibration/eval: the
# synthetic corpus (128 calib / 200 eval, disjoint) made by `tarq-deploy corpus synth`.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
cd /work/main
W=/tmp/pitfalls
CAL=/tmp/evalwork/corpora/synth/calib.jsonl
TD=(python -m tarq_deploy.cli)
q() { local name=$1; shift; [ -d "$W/ck-$name" ] || "${TD[@]}" quantize --model packaged:tiny.en --calib "$CAL" --n-calib 128 "$@" --out "$W/ck-$name";
      "${TD[@]}" export --target whisper.cpp "$W/ck-$name" -o "$W/$name.bin" --quiet; }
q tarq-mu1 --method tarq
q tarq-mu0 --method tarq --head-identity-weight 0
q gptq-mu1 --method gptq
q rarebal-mu1 --method rarebal
q tarq-nopack --method tarq --no-pack
q gptq-mu0 --method gptq --head-identity-weight 0
echo ALL-QUANTIZED
