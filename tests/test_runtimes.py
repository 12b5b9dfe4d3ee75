"""The one runtime registry: which runtime a model source runs on when eval is given no --backend."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_gguf

from tarq_deploy.errors import UserError
from tarq_deploy.runtimes import crispasr, qwen3_asr_cpp
from tarq_deploy.runtimes.registry import ADAPTERS, BY_NAME, FALLBACK, bench_runtimes, infer_runtime


@pytest.mark.parametrize("arch,runtime", [(crispasr.ARCH, crispasr.NAME), (qwen3_asr_cpp.ARCH, qwen3_asr_cpp.NAME)])
def test_a_gguf_runs_on_the_runtime_of_its_architecture(tmp_path: Path, arch: str, runtime: str) -> None:
    assert infer_runtime(str(tiny_gguf(tmp_path / "m.gguf", arch))) == runtime


def test_a_gguf_of_an_unknown_architecture_is_refused_not_sent_to_pytorch(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="m.gguf"):
        infer_runtime(str(tiny_gguf(tmp_path / "m.gguf", "llama")))


def test_anything_else_falls_back_to_pytorch(tmp_path: Path) -> None:
    assert infer_runtime(str(tmp_path / "some-transformers-dir")) == FALLBACK


def test_every_adapter_is_listed_once_and_the_bench_runtimes_come_from_the_same_list() -> None:
    names = [adapter.name for adapter in ADAPTERS]
    assert len(names) == len(set(names)) == len(BY_NAME)
    assert set(bench_runtimes()) <= set(names) and "whisper.cpp" in bench_runtimes()


def test_qwen3_asr_cpp_output_with_broken_utf8_is_kept(tmp_path):
    from tarq_deploy.runtimes.qwen3_asr_cpp import run_qwen3_asr_cpp

    fake = tmp_path / "qwen3-asr-cli"
    fake.write_text("#!/bin/sh\nprintf 'caf\\303 au lait\\n'\nprintf 'tokens: 1 2\\342\\202\\n' >&2\n")
    fake.chmod(0o755)
    done = run_qwen3_asr_cpp(fake, tmp_path / "m.gguf", tmp_path / "a.wav", 1, 8, 30)
    assert done.returncode == 0 and done.stdout == "caf\ufffd au lait\n" and "\ufffd" in done.stderr
