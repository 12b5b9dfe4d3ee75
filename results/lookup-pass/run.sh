#!/bin/bash
# The lookup pass of results/lookup-pass/README.md, for one calibration manifest (default: the dev-tuning set).
# Pass 1 is `tarq-deploy quantize` with every default but one pass (`--lookup-pass off`: the product now runs the
# lookup pass itself at IQ2_XS, `quantize` alone reproduces it); pass 2 recalibrates with pass 1's token table as the
# quantized stream's lookup; the head of pass 1 is put back; both files exported and tried on jfk in whisper.cpp.
set -eu
C=${C:-corpora/synth/calib.jsonl}; N=${N:-128}; W=${W:-runs/lookup-pass}; T=${T:-.venv/bin/tarq-deploy}
P=${P:-.venv/bin/python}
mkdir -p $W
$T quantize --model packaged:base --type iq2_xs --calib $C --n-calib $N --lookup-pass off --out $W/pass1
sed -e "s#corpora/synth/calib.jsonl#$C#" -e "s#\"--n-calib\", \"128\"#\"--n-calib\", \"$N\"#" \
    results/lookup-pass/second_pass.py > $W/second_pass.py
$P $W/second_pass.py $W/pass1 $W/pass2
$P results/lookup-pass/keep_first_head.py $W/pass1 $W/pass2 $W/pass2-head1
for m in pass1 pass2 pass2-head1; do $T export --target whisper.cpp --checkpoint $W/$m --out $W/$m.bin; done
$P results/lookup-pass/jfk.py $W/pass1.bin $W/pass2.bin $W/pass2-head1.bin
# dev split, teacher-forced against F16 (eval-dev-second-pass-report.md: pass2-head1 vs pass1)
$T eval --data dev=corpora/synth/eval.jsonl --reference F16 --teacher-forced-only --model F16=packaged:base \
    --backend torch --resamples 2000 --threads 2 --quiet --model lookup-w1=$W/pass2-head1 --model old=$W/pass1 \
    --compare lookup-w1:old -o $W/eval-dev
$P results/lookup-pass/roles.py $W/pass1
