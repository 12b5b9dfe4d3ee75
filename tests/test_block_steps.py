"""Whisper's block step programs (models/whisper.py ``steps``): the driver runs each window through a block once,
solving each group of Linears between the steps, instead of re-running the block up to every group. A step program
must give, group by group, the inputs the Linears receive in the module's own forward, and the module's output, bit
for bit, including after a group's weights change between the steps."""
from __future__ import annotations

import pytest
import torch

from tarq_deploy.models.whisper import WhisperBackbone
from tarq_deploy.quant.backbone import Window, finish_steps, input_hooks

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WINDOW = Window(inputs={}, masks={})


def hooked_inputs(stage, block, h, stream) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    rels = [rel for group in block.groups for rel in group]
    with torch.no_grad(), input_hooks(block.module, rels, lambda rel, x: seen.setdefault(rel, x.clone())):
        stage.call_block(block.module, h, WINDOW, stream)
    return seen


@pytest.mark.parametrize("stage_index", [0, 1], ids=["encoder", "decoder"])
def test_a_step_program_gives_the_modules_inputs_and_output_bit_for_bit(tiny, stage_index):
    model, processor, generation_config = tiny
    backbone = WhisperBackbone(model, processor, generation_config)
    stage = backbone.stages()[stage_index]
    generator = torch.Generator().manual_seed(stage_index)
    stream = {"encoder_out": torch.randn(1, 1500, 384, generator=generator)}
    h = torch.randn(1, 1500 if stage_index == 0 else 41, 384, generator=generator)
    block = stage.blocks[1]
    original = {n: p.detach().clone() for n, p in block.module.named_parameters()}
    try:
        program = stage.steps(block.module, h, WINDOW, stream)
        with torch.no_grad():
            for group in block.groups:
                expected = hooked_inputs(stage, block, h, stream)  # the module's forward with the weights so far
                got = next(program)
                assert list(got) == group
                for rel in group:
                    assert torch.equal(got[rel].reshape(expected[rel].shape), expected[rel]), rel
                for rel in group:  # the group is "solved": its weights change before the program goes on
                    block.linear(rel).weight.mul_(0.9)
            out = finish_steps(program)
            assert torch.equal(out, stage.call_block(block.module, h, WINDOW, stream))
    finally:
        with torch.no_grad():
            for name, parameter in block.module.named_parameters():
                parameter.copy_(original[name])
