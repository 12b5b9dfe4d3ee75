# Sourced by run_final_round2.sh and run_seed_spread.sh: the shared settings and one checkpoint step.
# checkpoint LABEL METHOD [QUANTIZE FLAGS...]: calibrate $WORK/ck/LABEL (timed into $WORK/times.txt) unless it
# exists, export it to $WORK/bin/LABEL.bin (whisper.cpp Q4_0) unless that exists, and verify the file bit-exact.
set -euo pipefail
export OMP_WAIT_POLICY=PASSIVE
WORK=${WORK:-/tmp/r}
TD=(python -m tarq_deploy.cli)
SYNTH="$WORK/synth"
MODEL=packaged:base

checkpoint() {
  local label=$1 method=$2; shift 2
  local ckpt="$WORK/ck/$label" bin="$WORK/bin/$label.bin"
  [ -f "$ckpt/manifest.json" ] || { /usr/bin/time -f "$label calibration %e s" -a -o "$WORK/times.txt" \
      "${TD[@]}" quantize --model "$MODEL" --calib "$SYNTH/calib.jsonl" --method "$method" "$@" --out "$ckpt" ; }
  mkdir -p "$WORK/bin"
  [ -f "$bin" ] || "${TD[@]}" export --target whisper.cpp "$ckpt" -o "$bin" --quiet
  "${TD[@]}" verify "$bin" --against "$ckpt" > /dev/null
}
