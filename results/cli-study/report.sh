#!/usr/bin/env bash
# One report over every file the study's sweep made, with the pairs the sweep report does not make (across types:
# TARQ Q3_K against ggml's Q4_0, TARQ Q4_0 against ggml's Q5_0; TARQ against imatrix). Nothing is decoded again: the
# sweep's hypothesis caches are copied in under this report's labels (the cache identity is the file's sha256, the
# threads and the decode settings, so a hit needs the very bytes the sweep decoded).
#   results/cli-study/report.sh cli      # after: tarq-deploy sweep results/cli-study/sweep.toml -o runs/cli-study
#   results/cli-study/report.sh greedy   # after: tarq-deploy sweep results/cli-study/sweep-greedy.toml -o runs/cli-study
#   EXTRA=runs/cli-study-greedy-tarq results/cli-study/report.sh greedy   # as this study's greedy report was made
#   SWEEP=runs/cli-study-tiny MODEL=tiny.en results/cli-study/report.sh cli  # the tiny.en half (results/cli-study-tiny)
set -euo pipefail
profile=${1:-cli}
sweep=${SWEEP:-runs/cli-study}
model=${MODEL:-base}
out=$sweep-$profile
files=$sweep-files
mkdir -p "$out/hypotheses" "$files"
m=${model//./\\.}  # the model's name as a sed pattern (tiny.en)
short() {  # a sweep label or file stem (base_-_ggml_q4_0 / base---ggml-q4_0) -> ggml-q4_0
  sed -E -e "s/^$m(_-_|---)f16(_|-)f16/f16/" \
         -e "s/^$m(_-_|---|_synth_|-synth-)([a-z]+)(_|-)((i?q)[0-9a-z_]+)\$/\\2-\\4/" <<<"$1"
}
done_labels=" "
for step in "$sweep"/steps/eval/*/; do
  [[ -f $step/done.json ]] || continue  # an eval step still running is left out, never decoded here
  for cache in "$step"hypotheses/*__"$profile".jsonl; do
    [[ -f $cache ]] || continue
    stem=$(basename "$cache"); label=$(short "${stem%%__*}")
    cp "$cache" "$out/hypotheses/${label}__${stem#*__}"; done_labels+="$label "
  done
done
# EXTRA: eval output folders whose caches stand in for cells the sweep did not finish (their labels are this
# report's: tarq-q4_0, ...); a cache that is not complete is completed by the eval below, never taken as done
for extra in ${EXTRA:-}; do
  for cache in "$extra"/hypotheses/*__"$profile".jsonl; do
    [[ -f $cache ]] || continue
    stem=$(basename "$cache"); cp "$cache" "$out/hypotheses/$stem"; done_labels+="${stem%%__*} "
  done
done
models=(); have=()
for bin in "$sweep"/steps/export/*/*.bin; do
  name=$(short "$(basename "$bin" .bin)")
  if [[ $done_labels != *" $name "* ]]; then echo "report.sh: $name has no finished $profile eval: left out" >&2; continue; fi
  ln -sf "$(realpath "$bin")" "$files/$name.bin"
  models+=(--model "$name=$files/$name.bin"); have+=("$name")
done
pairs=()
pair() { [[ " ${have[*]} " == *" $1 "* && " ${have[*]} " == *" $2 "* ]] && pairs+=(--compare "$1:$2") || true; }
for type in q5_0 q4_0 q3_k iq3_s; do
  for other in ggml imatrix gptq; do pair "tarq-$type" "$other-$type"; done
  pair "imatrix-$type" "ggml-$type"; pair "gptq-$type" "ggml-$type"
done
pair tarq-q3_k ggml-q4_0; pair tarq-q4_0 ggml-q5_0; pair gptq-q3_k ggml-q4_0
data=(--data test=corpora/synth/test.jsonl)  # greedy: the test split only, as its sweep decoded
if [[ $profile == cli ]]; then  # the long recordings only where the sweep decoded them (the IQ3_S sweep did not)
  compgen -G "$out/hypotheses/*__long__cli.jsonl" >/dev/null && data+=(--data long=corpora/long/long.jsonl)
  data+=(--nonspeech corpora/nonspeech/nonspeech.jsonl)
fi
tarq-deploy eval --decode "$profile" "${data[@]}" "${models[@]}" "${pairs[@]}" \
    --reference f16 --threads 1 --jobs 1 --resamples 2000 --out "$out" --quiet
