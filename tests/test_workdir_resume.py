"""A work directory damaged between an interruption and the resume: a block whose bytes changed (a flipped bit, still
a readable safetensors file) is caught by its recorded hash, an unreadable block with no hash to compare by its
reader; each is recomputed from that block, with one warning naming the file, and the resumed checkpoint has the
bytes of an uninterrupted run. (An interruption with the work directory intact is pinned on real tiny.en in
test_quantize_whisper.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import calibration_interrupted_at

from tarq_deploy.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: small torch ops, one thread


def test_corrupted_block_in_the_work_dir_is_recomputed(models, corpus, tmp_path):
    from tarq_deploy.calibration.options import QuantizeOptions
    from tarq_deploy.calibration.pipeline import quantize_backbone
    from tarq_deploy.data.corpus import load_corpus
    from tarq_deploy.formats.backbones import load_backbone

    options = QuantizeOptions(method="tarq", encoder_tagging="none")
    utterances = load_corpus(corpus)
    logged: list[str] = []

    def run(work: Path, out: Path) -> Path:
        ckpt, _ = quantize_backbone(load_backbone(str(models["clean"])), utterances, options, "tiny", work,
                                    log=logged.append)
        return save_checkpoint(ckpt, out)

    reference = run(tmp_path / "ref.partial", tmp_path / "ref")
    work = tmp_path / "res.partial"
    with calibration_interrupted_at(3):  # at the head: both encoder and decoder blocks are in the work directory
        run(work, tmp_path / "res")
    block = work / "block-0001.safetensors"
    data = bytearray(block.read_bytes())
    data[-5] ^= 0x40  # one flipped bit in the last codes: still a readable safetensors file
    block.write_bytes(bytes(data))
    logged.clear()
    resumed = run(work, tmp_path / "res")
    warnings = [line for line in logged if line.startswith("warning")]
    assert len(warnings) == 1 and str(block) in warnings[0] and "recomputing from block 1" in warnings[0]
    for name in ("manifest.json", "lattice.safetensors", "tensors.safetensors"):
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name

    (work / "block-0000.safetensors").write_bytes(b"not safetensors")  # unreadable, and no hash to compare
    progress = json.loads((work / "progress.json").read_text())
    progress["block_sha256"] = []
    (work / "progress.json").write_text(json.dumps(progress))
    logged.clear()
    again = run(work, tmp_path / "again")
    assert any("block-0000.safetensors: not a readable safetensors file" in line for line in logged)
    assert (again / "lattice.safetensors").read_bytes() == (reference / "lattice.safetensors").read_bytes()
