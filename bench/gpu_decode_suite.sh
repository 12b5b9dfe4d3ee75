#!/usr/bin/env bash
# Issue 29 on one lent GPU (an H100): everything in one call, at most BUDGET_S (400 s) + ~15 s wall, each stage
# under `timeout`, a stage failing never stops the next, JSON written as it goes (a cut run keeps what it measured).
#
#   device:  bash bench/gpu_decode_suite.sh                     (run in the repo root; $OUT comes back)
#   here:    PYTHON=.venv/bin/python bash bench/gpu_decode_suite.sh --dry   (no GPU: every stage takes its no-CUDA path,
#            proving that the script parses and that its modules import with the device's packages only)
#
# Stages (limits in seconds; a stage gets at most what is left of BUDGET_S, and is skipped under 20 s):
#   env     nvidia-smi, python packages, the imports the stages need                         (~10 s)
#   decode  python -m tarq_deploy.bench.gpu_decode: Voxtral-Mini-3B LM, 30 layers, CUDA graphs,
#           FP16 / INT4 tinygemm / INT4 triton, per-Linear kernels      -> gpu_decode.json/.md  (~90-150 s; 230)
#   tests   pytest tests/test_triton_w4a16.py (the kernel vs the lattice at Voxtral shapes)   (~40-60 s; 120)
#   whisper bench/gpu_whisper_decode_cap.py: large-v3 dims, max_new_tokens held, triton in
#           transformers' Whisper                                       -> whisper_check.json   (~40-70 s; 100)
set -u
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-/tmp/gpu_decode_suite_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BUDGET_S=${BUDGET_S:-400}
START=$(date +%s)
exec > >(tee -a "$OUT/log.txt") 2>&1

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 left t rc
    shift 2
    left=$((BUDGET_S - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "== $name: SKIPPED, ${left}s of the ${BUDGET_S}s budget left"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name: start $(date +%T), limit ${limit}s: $*"
    t=$(date +%s)
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "== $name: rc=$rc after $(($(date +%s) - t))s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')"
    return 0
}

env_check() {
    nvidia-smi || echo "nvidia-smi: not available (rc=$?)"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv 2>/dev/null
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "transformers", "numpy", "safetensors", "xxhash", "numba", "tqdm", "scipy",
             "psutil", "pynvml", "pytest", "gguf"):
    try:
        module = importlib.import_module(name)
        print(f"{name:13s}", getattr(module, "__version__", "?"))
    except Exception as e:  # what is missing is said, not fatal
        print(f"{name:13s} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import tarq_deploy.bench.gpu, tarq_deploy.bench.gpu_decode, tarq_deploy.runtimes.triton_w4a16  # noqa: F401
from tarq_deploy.runtimes.triton_w4a16 import triton_unavailable_reason
print("triton W4A16 on cuda:", triton_unavailable_reason("cuda") or "available")
EOF
}

if [ $DRY -eq 1 ]; then
    echo "== dry run: no GPU expected; bash syntax:"
    bash -n "$0" && echo "syntax ok"
    echo "== dry run: the stages' modules import without the packages the device lacks"
    "$PY" - <<'EOF' || echo "IMPORT CHECK FAILED"
import importlib.abc, sys
ABSENT = {"gguf", "wordfreq", "jiwer", "soundfile", "whisper_normalizer", "piper", "ctranslate2", "pywhispercpp",
          "crispasr", "compressed_tensors", "datasets", "ray", "faster_whisper", "vllm", "gptqmodel"}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ImportError(f"not on the device: {name}")
sys.meta_path.insert(0, Absent())
sys.path[:0] = ["tests", "bench"]
for name in ("tarq_deploy.bench.gpu_decode", "tarq_deploy.bench.gpu", "tarq_deploy.runtimes.triton_w4a16",
             "tarq_deploy.runtimes.int4_linear", "conftest", "test_triton_w4a16", "gpu_whisper_decode_cap"):
    __import__(name)
print("imports ok without", sorted(ABSENT))
EOF
    LAYERS=1
else
    LAYERS=${LAYERS:-30}
fi

export -f env_check
export PY
stage env 60 bash -c env_check 2>&1 | tee "$OUT/env.txt"
stage decode 230 "$PY" -m tarq_deploy.bench.gpu_decode --layers "$LAYERS" --context 383 --new-tokens 64 \
    --repeats 5 --kernels tinygemm,triton --out "$OUT/gpu_decode.json"
stage tests 120 "$PY" -m pytest tests/test_triton_w4a16.py -q -rs -p no:cacheprovider
stage whisper 100 "$PY" bench/gpu_whisper_decode_cap.py --layers "$([ $DRY -eq 1 ] && echo 1 || echo 32)" \
    --max-new-tokens 64 --runs 2 --out "$OUT/whisper_check.json"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv 2>/dev/null
echo "== done after $(($(date +%s) - START))s; files in $OUT:"
ls -la "$OUT"
sleep 1  # let tee write the last lines into log.txt
