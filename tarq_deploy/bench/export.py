"""whisper.cpp export time against plain I/O, for Whisper tiny.en, base (real weights) and small (real dimensions,
random weights: no complete small checkpoint is available offline).

    python -m tarq_deploy.bench.export [--models tiny.en,base,small] [--types q4_0,...,q6_k] [--repeats 3]
                                       [--out bench/results/export.json]

Per model, medians of ``--repeats`` runs, from an RTN lattice checkpoint directory of each type:

* ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q8_0``, ``q4_k``, ``q5_k``, ``q6_k``: checkpoint directory -> model file
  of that type (load_checkpoint with its hash check, packing, writing): what ``tarq-deploy export`` does after
  start-up; also each stage alone (F16 values are made while the file is written, so they count in ``write_s``,
  not ``pack_s``). The K-quants only where the model's width is a multiple of 256 (not tiny.en).
* ``f16``: the Q4_0 checkpoint -> F16 model file (every value decoded from the checkpoint's blocks and rounded to
  fp16: a computation, not a copy).
* ``f16_from_model``: the in-memory transformers model -> F16 model file (every value converted, the vocabulary
  derived from the tokenizer object).
* ``load_checkpoint_s`` / ``load_without_digests_s`` / ``load_with_sha256_s``: the load as export does it (xxh3
  digests), without any digest check, and with the sha256 check ``verify`` adds.
* ``io_s``: the floor an exporter cannot beat: reading the checkpoint's files and writing as many bytes as the
  output has to a new file (for ``f16_from_model`` only the write: its source is already in memory).
  ``ratio``: the median over repeats of export / floor, each pair timed back to back (``ratio_of_medians``
  beside it).
* ``replace_s``: the export again, over the output of the previous run instead of to a new path. On ext4 renaming a
  new file over an existing one makes the kernel allocate and start writing the new file's blocks at once
  (auto_da_alloc, its guard against empty files after a crash): a cost of replacing a file, not of exporting, which
  the floor does not pay either, so it is reported beside the ratio rather than in it.

Every timed write, the export's and the floor's alike, goes to a path that does not exist yet and is removed after
the timing; an earlier version of this benchmark removed the floor's file inside its timing (the kernel then drops
the pages before doing anything with them) and exported over the same path each run, which measured the two
different things above.

OMP_WAIT_POLICY defaults to PASSIVE here: on a shared machine torch's spinning OpenMP threads made the checkpoint's
small tensor ops 5-15x slower. Goals from the issues: exporting whisper small finishes in a few seconds; every
type's export stays within 2x of the I/O floor.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import torch  # noqa: E402

from tarq_deploy.formats.whisper_cpp import as_source, build_whisper_cpp, export_whisper_cpp, write_whisper_cpp  # noqa: E402
from tarq_deploy.checkpoint import LatticeCheckpoint, load_checkpoint, save_checkpoint  # noqa: E402
from tarq_deploy.fileio import write_json_atomic  # noqa: E402
from tarq_deploy.quant.choices import GGML_TYPES, K_QUANT_ROW  # noqa: E402
from tarq_deploy.quant.lattice import LatticeSpec  # noqa: E402
from tarq_deploy.quant.lattice_fit import quantize_rtn  # noqa: E402

SPEC = LatticeSpec(bits=4, group_size=32)  # one lattice group per Q4_0 block: the natural ggml lattice
SMALL_DIMS = dict(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
IO_CHUNK = 1 << 24


def load_bundle(name: str):
    """(model, processor, generation_config): packaged tiny.en / base; small = base's processor with small's dims."""
    from tarq_deploy.formats.model_loader import load_whisper

    if name != "small":
        return load_whisper(f"packaged:{name}")
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    _, processor, generation_config = load_whisper("packaged:base")  # multilingual vocabulary, as small's
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51865, num_mel_bins=80, max_source_positions=1500, max_target_positions=448,
                           **SMALL_DIMS)
    model = WhisperForConditionalGeneration(config).eval()
    return model, processor, generation_config


def type_spec(type_name: str) -> LatticeSpec:
    scheme, bits, group = GGML_TYPES[type_name]
    return LatticeSpec(bits, group, scheme)


def rtn_checkpoint(bundle, spec: LatticeSpec = SPEC) -> LatticeCheckpoint:
    model, processor, generation_config = bundle
    state = model.state_dict()
    linear = sorted(f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    quantized = {name: quantize_rtn(state[name], spec) for name in linear}
    aliases = {"model.decoder.embed_tokens.weight": "proj_out.weight"}
    tensors = {k: v for k, v in state.items() if k not in quantized and k not in aliases}
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    return LatticeCheckpoint(spec, quantized, tensors, aliases, {"method": {"name": "rtn"}}, files)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_time_new_file(write: Callable[[Path], object], work: Path, repeats: int) -> float:
    """Median time of ``write(path)`` to a path that does not exist yet; the file is removed after each timing."""
    return statistics.median(times_new_file([write], work, repeats)[0])


def times_new_file(writers: list[Callable[[Path], object]], work: Path, repeats: int) -> list[list[float]]:
    """Times of each ``write(path)``, to a new path each time (removed after the timing), the writers taking turns
    within every repeat so that a slow spell of a shared machine falls on all of them alike."""
    times: list[list[float]] = [[] for _ in writers]
    for i in range(repeats):
        for write, column in zip(writers, times):
            path = work / f"new-{i}.bin"
            start = time.perf_counter()
            write(path)
            column.append(time.perf_counter() - start)
            path.unlink()
    return times


def against_floor(export: list[float], floor: list[float]) -> dict:
    """Medians of the export and of the floor, and the ratio as the median of the ratios of the pairs timed side by
    side (a slow spell of the machine moves both members of a pair); the ratio of the medians beside it."""
    return {"export_s": statistics.median(export), "io_s": statistics.median(floor),
            "ratio": statistics.median(e / f for e, f in zip(export, floor)),
            "ratio_of_medians": statistics.median(export) / statistics.median(floor)}


def read_files(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(IO_CHUNK):
                total += len(chunk)
    return total


@functools.cache
def _random_block() -> bytes:
    """Made once, outside the timings: generating random bytes is not part of the I/O floor."""
    return os.urandom(IO_CHUNK)


def write_bytes(path: Path, n: int) -> None:
    block = memoryview(_random_block())  # slices of a memoryview copy nothing
    with open(path, "wb") as f:
        for start in range(0, n, len(block)):
            f.write(block[:min(len(block), n - start)])


def bench_checkpoint(ckpt_dir: Path, target: str, work: Path, repeats: int) -> dict:
    """Checkpoint directory -> model file, as ``tarq-deploy export`` does it, split into its stages."""
    out = export_whisper_cpp(ckpt_dir, work / f"model-{target}.bin", target)
    files = [p for p in ckpt_dir.rglob("*") if p.is_file()]
    size = out.stat().st_size
    timed = against_floor(*times_new_file([lambda path: export_whisper_cpp(ckpt_dir, path, target),
                                           lambda path: (read_files(files), write_bytes(path, size))], work, repeats))
    replace = median_time(lambda: export_whisper_cpp(ckpt_dir, out, target), repeats)
    load = median_time(lambda: load_checkpoint(ckpt_dir), repeats)
    load_unverified = median_time(lambda: load_checkpoint(ckpt_dir, verify_hashes=False), repeats)
    load_sha256 = median_time(lambda: load_checkpoint(ckpt_dir, sha256=True), repeats)
    source = as_source(load_checkpoint(ckpt_dir))
    pack = median_time(lambda: build_whisper_cpp(source, target), repeats)
    built = build_whisper_cpp(source, target)
    write = median_time_new_file(lambda path: write_whisper_cpp(built, path), work, repeats)
    out.unlink()
    return {**timed, "replace_s": replace, "load_checkpoint_s": load, "load_without_digests_s": load_unverified,
            "load_with_sha256_s": load_sha256, "pack_s": pack, "write_s": write,
            "source_bytes": sum(p.stat().st_size for p in files), "output_bytes": size}


def bench_model_f16(bundle, work: Path, repeats: int) -> dict:
    """In-memory transformers model -> F16 model file; its floor is writing the output (the source is in memory)."""
    source = as_source(bundle)
    pack = median_time(lambda: build_whisper_cpp(source, "f16"), repeats)
    built = build_whisper_cpp(source, "f16")
    write = median_time_new_file(lambda path: write_whisper_cpp(built, path), work, repeats)
    size = built.nbytes
    timed = against_floor(*times_new_file([lambda path: export_whisper_cpp(bundle, path, "f16"),
                                           lambda path: write_bytes(path, size)], work, repeats))
    return {**timed, "pack_s": pack, "write_s": write, "output_bytes": size}


def bench_model(name: str, types: list[str], repeats: int) -> dict:
    bundle = load_bundle(name)
    width = bundle[0].config.d_model
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for type_name in types:
            spec = type_spec(type_name)
            if spec.two_level and width % K_QUANT_ROW:
                continue  # the K-quants pack rows of 256 values
            ckpt_dir = save_checkpoint(rtn_checkpoint(bundle, spec), work / f"ckpt-{type_name}")
            rows[type_name] = bench_checkpoint(ckpt_dir, type_name, work, repeats)
            if type_name == "q4_0":
                rows["f16"] = bench_checkpoint(ckpt_dir, "f16", work, repeats)
            shutil.rmtree(ckpt_dir)
        rows["f16_from_model"] = bench_model_f16(bundle, work, repeats)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny.en,base,small")
    parser.add_argument("--types", default=",".join(GGML_TYPES), help="lattice types to export (comma-separated)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("-o", "--out", default="runs/bench/export.json")
    args = parser.parse_args()
    types = args.types.split(",")
    unknown = [t for t in types if t not in GGML_TYPES]
    if unknown:
        parser.error(f"--types: unknown {', '.join(unknown)}; known: {', '.join(GGML_TYPES)}")
    logging.getLogger("tarq_deploy.formats.whisper_cpp").setLevel(logging.ERROR)  # the F16 rounding note, once per run
    result = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "python": platform.python_version()}, "repeats": args.repeats, "lattice": "RTN of each type",
              "models": {}}
    for name in args.models.split(","):
        row = result["models"][name] = bench_model(name, types, args.repeats)
        for target, r in row.items():
            print(f"{name:8s} {target:15s} export {r['export_s']:5.2f} s (pack {r['pack_s']:.2f} s, write "
                  f"{r['write_s']:.2f} s), I/O floor {r['io_s']:.2f} s, ratio {r['ratio']:4.1f}x, "
                  f"output {r['output_bytes'] / 1e6:6.1f} MB")
    out = write_json_atomic(args.out, result, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
