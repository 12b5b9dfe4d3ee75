#!/usr/bin/env bash
# Dev-split ablation, second round (issue 18): the calibration-data and metric candidates the first round left out --
# 512 vs 128 calibration utterances (GPTQ and TARQ), the rare-biased pools r-top and r-mix, mu = 0 (the tied head's
# token-lookup term off), no encoder tagging (rareBAL on the decoder only), the residual step alone, and a lighter
# tail weight (c = 0.25). Base, Q4_0 lattice
# (group 32), every other option at its default. Teacher-forced figures against F16 on the dev split only; the test
# split is not touched. Run from the repository root; corpora and checkpoints go to $WORK (default /tmp/r), the
# teacher-forced caches to results/rarewords/dev-caches/round2/. Resumable: what exists is reused.
# The first round's caches (dev-caches/round1/) were scored on an earlier synthesis of the same dev sentences whose
# audio bytes differ from today's, so this round re-runs its own baselines (the GPTQ and TARQ defaults, RTN,
# imatrix) and every comparison pairs caches of one round only.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
WORK=${WORK:-/tmp/r}
TD=(python -m tarq_deploy.cli)
SYNTH="$WORK/synth"
[ -f "$SYNTH/calib.jsonl" ] || "${TD[@]}" corpus synth --out "$SYNTH" --n 200 --n-test 200 --n-calib 512 \
    --voices slt,joe --test-voices kal --seed 0

variant() {  # LABEL METHOD FLAGS...
  local label=$1 method=$2; shift 2
  local ckpt="$WORK/ck/$label"
  [ -f "$ckpt/manifest.json" ] || { /usr/bin/time -f "$label calibration %e s" -a -o "$WORK/times.txt" \
      "${TD[@]}" quantize --model packaged:base --calib "$SYNTH/calib.jsonl" --method "$method" "$@" --out "$ckpt" ; }
  local cache=results/rarewords/dev-caches/round2/$label.jsonl
  mkdir -p "$(dirname "$cache")"
  if [ ! -f "$cache" ]; then
    "${TD[@]}" eval --data dev="$SYNTH/eval.jsonl" --model F16=packaged:base --model "$label=$ckpt" \
        --reference F16 --teacher-forced-only --out "$WORK/eval-$label" --quiet
    cp "$WORK/eval-$label/teacher-forced/$label.jsonl" "$cache"
  fi
}

variant GPTQ gptq
variant TARQ tarq
variant TARQ-n512 tarq --n-calib 512
variant GPTQ-n512 gptq --n-calib 512
variant TARQ-rtop tarq --pool r-top
variant RESIDUAL residual
variant TARQ-c0.25 tarq --cost-ratio 0.25
variant TARQ-rmix tarq --pool r-mix
variant TARQ-mu0 tarq --head-identity-weight 0
variant TARQ-enc-none tarq --encoder-tagging none
variant RTN rtn
variant IMATRIX imatrix
