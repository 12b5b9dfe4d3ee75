#!/usr/bin/env bash
# Calibration cost on one lent GPU (issue 41, measurement 1): large-v3 at real dimensions (128 mel bins, its 51,866-token
# vocabulary, random float16 weights), 128 utterances, one method per call (GPTQ in one, TARQ in the next), time per
# stage and peak VRAM, through the memory-bounded driver. JSON under $OUT as it finishes; the cell stops itself
# (bench.calibration --max-seconds) well inside the call's limit and records how far it got.
#
#   here, once:  .venv/bin/python -m tarq_deploy.bench.calibration --prepare-carry .carry   (clips, processor, site/;
#                ~6 MB; .carry is ignored by git: echo /.carry/ >> .git/info/exclude)
#   device:      bash bench/gpu_calibration.sh gptq        then        bash bench/gpu_calibration.sh tarq
#                (carry: .carry)
#   dry run:     PYTHON=.venv/bin/python DEVICE=cpu DIMS=tiny N=2 LIMIT_S=240 bash bench/gpu_calibration.sh gptq
#                (what make test runs: the same script, the same modules, at tiny dimensions on the CPU)
set -u
METHOD=${1:?usage: gpu_calibration.sh gptq|tarq}
OUT=${OUT:-/tmp/gpu_calibration_out}
CARRY=${CARRY:-.carry}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DIMS=${DIMS:-large-v3}
N=${N:-128}
LIMIT_S=${LIMIT_S:-500}  # the cell's own stop; the device's per-call limit is 600 s, the machine's start excluded
mkdir -p "$OUT"
export PYTHONPATH=".:$CARRY/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/log-$METHOD.txt") 2>&1

echo "== env $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not available"
"$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm", "wordfreq", "regex", "msgpack"):
    try:
        print(f"{name:13s}", getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # said, not fatal: the cell below fails with the reason
        print(f"{name:13s} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

echo "== calibration $METHOD $DIMS n=$N on $DEVICE, limit ${LIMIT_S}s: $(date +%T)"
"$PY" -m tarq_deploy.bench.calibration --dims "$DIMS" --n "$N" --methods "$METHOD" --device "$DEVICE" \
    --clips "$CARRY/clips.jsonl" --processor "$CARRY/processor" --settle-seconds 0 --max-seconds "$LIMIT_S" \
    --out "$OUT/calibration-$DIMS-$METHOD.json"
echo "== done rc=$? $(date +%T)"
