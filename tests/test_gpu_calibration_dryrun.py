"""The lent-GPU calibration script (bench/gpu_calibration.sh, issue 41) dry-run on the CPU at tiny dimensions: the
same script and modules the device runs, fed only by what --prepare-carry writes (the clips, a processor folder and
the pure-Python packages a GPU machine lacks, wordfreq with its English tables only), so that the first device
minute is not spent finding a missing file or package."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from tarq_deploy.bench.calibration import main

REPO = Path(__file__).resolve().parents[1]

# The lent GPU image's Python packages (its list in the device README's KINDS.md, read 2026-11-17): distribution
# names with '-' as '_', then the import names that differ and modules its packages bring along. Anything else
# installed here is hidden from the dry run, so a package the image lacks fails here as it would there (the first
# device call of 2026-11-27 lost a start to 'gguf').
DEVICE_IMAGE = {
    "absl_py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated_doc", "anyio", "attrs",
    "botorch", "build", "certifi", "charset_normalizer", "chex", "click", "cloudpickle", "cmake", "colorama",
    "contourpy", "coverage", "cuda_bindings", "cuda_core", "cuda_pathfinder", "cuda_toolkit", "cupy_cuda13x",
    "cycler", "cython", "diffrax", "e3nn", "einops", "equinox", "etils", "execnet", "filelock", "flatbuffers",
    "flax", "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py", "hf_xet",
    "httpcore", "httpx", "huggingface_hub", "humanize", "hypothesis", "idna", "imageio", "iniconfig",
    "interface_meta", "jax", "jax_cuda13_pjrt", "jax_cuda13_plugin", "jaxlib", "jaxtyping", "jinja2", "joblib",
    "kiwisolver", "lazy_loader", "lightning", "lightning_utilities", "linear_operator", "lineax", "llvmlite",
    "lxml", "markdown", "markdown_it_py", "markupsafe", "matplotlib", "mdurl", "meson", "ml_dtypes", "mpi4py",
    "mpmath", "msgpack", "multidict", "multipledispatch", "mypy_extensions", "nanobind", "narwhals", "networkx",
    "ninja", "numba", "numba_cuda", "numpy", "numpyro", "nvidia_cublas", "nvidia_cuda_cupti", "nvidia_cuda_nvrtc",
    "nvidia_cuda_runtime", "nvidia_cudnn_cu13", "nvidia_cufft", "nvidia_cufile", "nvidia_curand", "nvidia_cusolver",
    "nvidia_cusparse", "nvidia_cusparselt_cu13", "nvidia_ml_py", "nvidia_nccl_cu13", "nvidia_nvjitlink",
    "nvidia_nvshmem_cu13", "nvidia_nvtx", "onnx", "onnx_ir", "onnxruntime", "onnxscript", "opencv_python_headless",
    "opt_einsum", "opt_einsum_fx", "optax", "optimistix", "orbax_checkpoint", "packaging", "pandas", "pathspec",
    "patsy", "peft", "pillow", "pip", "pluggy", "portalocker", "prometheus_client", "propcache", "protobuf",
    "psutil", "py_cpuinfo", "pyarrow", "pybind11", "pygments", "pyparsing", "pyproject_hooks", "pyre_extensions",
    "pytest", "pytest_benchmark", "pytest_cov", "pytest_mock", "pytest_timeout", "pytest_xdist", "python_dateutil",
    "pytorch_lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu", "safetensors", "scikit_build_core",
    "scikit_image", "scikit_learn", "scipy", "seaborn", "sentence_transformers", "sentencepiece", "setuptools",
    "shellingham", "simplejson", "six", "sortedcontainers", "statsmodels", "sympy", "tabulate", "tensorboard",
    "tensorboard_data_server", "tensorstore", "threadpoolctl", "tifffile", "tiktoken", "timm", "tokenizers",
    "toolz", "torch", "torch_geometric", "torchaudio", "torchdiffeq", "torchmetrics", "torchvision", "tqdm",
    "transformers", "treescope", "triton", "typer", "typing_extensions", "typing_inspect", "urllib3", "uvloop",
    "wadler_lindig", "werkzeug", "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
    "PIL", "yaml", "_yaml", "cv2", "markdown_it", "dateutil", "google", "jax_cuda13_plugin", "pkg_resources",
    "_distutils_hack", "torchgen", "functorch", "sniffio", "hf_xet", "annotated_doc", "typing_inspection",
    "sklearn", "skimage", "attr", "pyparsing", "_pytest", "py", "mpl_toolkits"}

def device_image_site(directory: Path) -> Path:
    """A folder that stands in for this interpreter's site-packages on the dry run: links to the packages the image
    holds, nothing else, and a sitecustomize that puts it in site-packages' place (children inherit it through
    PYTHONPATH). Optional imports (soundfile, dill) then go missing as they do there, not just fail to import."""
    site = Path(sysconfig.get_paths()["purelib"])
    image = directory / "site"
    image.mkdir(parents=True)
    for entry in site.iterdir():
        name = re.split(r"[-.]", entry.name, maxsplit=1)[0]
        if name in DEVICE_IMAGE or name.lower().replace("-", "_") in DEVICE_IMAGE:
            (image / entry.name).symlink_to(entry)
    (directory / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"sys.path[:] = [p for p in sys.path if os.path.realpath(p) != {str(site.resolve())!r}] + [{str(image)!r}]\n")
    return directory


def test_the_device_script_runs_a_cell_from_the_carried_files_alone(tmp_path):
    carry, out = tmp_path / "carry", tmp_path / "out"
    assert main(["--prepare-carry", str(carry)]) == 0
    assert (carry / "site" / "wordfreq" / "data" / "large_en.msgpack.gz").is_file()
    assert not list((carry / "site" / "wordfreq" / "data").glob("large_de*"))  # English only: the carry stays small
    size = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert size < 16 << 20, size  # the device takes 64 MiB per call, the repository included
    image = device_image_site(tmp_path / "image")
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "DIMS": "tiny", "N": "2", "LIMIT_S": "300",
           "CARRY": str(carry), "OUT": str(out), "PYTHONPATH": str(image)}
    run = subprocess.run(["bash", "bench/gpu_calibration.sh", "gptq"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = (out / "log-gptq.txt").read_text()
    assert "wordfreq" in log and "MISSING" not in log, log
    rows = json.loads((out / "calibration-tiny-gptq.json").read_text())["rows"]
    assert len(rows) == 1 and "wall_s" in rows[0], rows  # finished, not stopped or failed
    assert rows[0]["weights_dtype"] == "float16" and rows[0]["blocks"] == 9
    assert rows[0]["stage_s"]["windows"] > 0 and "load_average_at_start" in rows[0]
