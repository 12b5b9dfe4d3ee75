#!/bin/bash
# Issue 37: the full-precision stream alone in bfloat16 (quantize --fp-stream-dtype bfloat16, an option that exists
# only at commit 477527c: run this there; the alignment pass,
# whose activations TARQ keeps as x_fp, under bfloat16 autocast; the quantized stream, the second moments and the
# solver stay float32/float64). x_fp enters only H_delta, through x_fp - x_q. Whisper base, TARQ, 128 synthetic
# calibration utterances of corpora/synth (seed 0), teacher-forced KLD against F16 on its 200-utterance dev split
# (eval.jsonl, voices slt and joe; never the test split). Run from the repository root after `make install` and the
# corpus command of bench/results/peers/README.md; W is scratch space. Each calibration runs alone.
set -eu
W=${W:-/tmp/fp-stream}
T=".venv/bin/tarq-deploy"
C=corpora/synth
mkdir -p "$W/ck"
SPECS="tarq:w4g128 tarq:q4_0 tarq:q3_k"
for spec in $SPECS; do
  method=${spec%%:*} type=${spec##*:}
  case $type in w4g128) lattice=(--target gptq --group-size 128);; *) lattice=(--type "$type");; esac
  for fp in float32 bfloat16; do
    out="$W/ck/$method-$type-fp-$fp"
    [ -f "$out/manifest.json" ] || /usr/bin/time -f "$method $type fp-stream $fp wall %e s maxrss %M KiB load $(cut -d' ' -f1 /proc/loadavg)" \
      -a -o "$W/times.txt" $T quantize --model packaged:base --calib "$C/calib.jsonl" --n-calib 128 --seed 0 \
      --method "$method" "${lattice[@]}" --compute-dtype float32 --fp-stream-dtype "$fp" --out "$out"
  done
done
args=(--data "dev=$C/eval.jsonl" --reference F16 --teacher-forced-only --model F16=packaged:base --backend torch
      --resamples 2000 --threads 2 --quiet)
for spec in $SPECS; do
  b="${spec%%:*}-${spec##*:}"
  args+=(--model "$b-fp-float32=$W/ck/$b-fp-float32")
  args+=(--model "$b-fp-bfloat16=$W/ck/$b-fp-bfloat16" --compare "$b-fp-bfloat16:$b-fp-float32")
done
$T eval "${args[@]}" -o "$W/eval"
