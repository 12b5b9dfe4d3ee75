"""Experiment, not product code (run from the repository root; it patches two internals of tarq_deploy at run
time): TARQ IQ2_XS of base whose decoder blocks are calibrated with the QUANTIZED token lookup in the quantized
stream (the table of an earlier TARQ IQ2_XS run, W1), the fp stream keeping the F16 lookup; the head is solved last
as usual and the file ties lookup and head as always (keep_first_head.py then puts W1 back as the head).
--lookup-pass off: the product's own two passes (its default at IQ2_XS since) are what this script emulates.
Usage: python results/lookup-pass/second_pass.py W1_CHECKPOINT OUT"""
import sys, torch
from tarq_deploy.models import whisper as wm
from tarq_deploy.models.from_checkpoint import load_dequantized_whisper
from tarq_deploy.quant import calibrate
from tarq_deploy import cli

w1 = load_dequantized_whisper(sys.argv[1])[0].proj_out.weight.detach().float().clone()
state = {"windows": None}
orig_init = calibrate.SequentialCalibrator.__init__
def init(self, stages, windows, *a, **k):
    state["windows"] = len(windows)
    orig_init(self, stages, windows, *a, **k)
calibrate.SequentialCalibrator.__init__ = init
orig_enter = wm._DecoderStage.enter
def enter(self, window, stream):
    if not self.blocks:  # the alignment pass: full precision
        return orig_enter(self, window, stream)
    n = getattr(self, "_calls", 0)
    self._calls = n + 1
    if n < state["windows"]:  # the driver enters the fp streams first, then the quantized ones
        return orig_enter(self, window, stream)
    dec = self.backbone.model.model.decoder
    ids = window.inputs["decoder_input_ids"].to(self.backbone.device)
    return w1.to(self.backbone.device)[ids] + dec.embed_positions.weight[: ids.shape[1]].float()
wm._DecoderStage.enter = enter
sys.exit(cli.main(["quantize", "--model", "packaged:base", "--type", "iq2_xs", "--calib", "corpora/synth/calib.jsonl",
                   "--n-calib", "128", "--lookup-pass", "off", "--out", sys.argv[2]]))
