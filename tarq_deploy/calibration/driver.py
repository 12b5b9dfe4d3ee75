"""The sequential calibration driver: block by block, paired full-precision and quantized streams.

For every block, in the backbone's calibration order:
  1. the full-precision copy of the block runs on the fp stream; the inputs of its Linears (x_fp) are kept (only for
     methods with the residual step: the others need no fp stream and run the quantized stream alone, like GPTQ);
  2. for each group of Linears in true-sequential order (attention inputs, output projection, MLP, ...), the partly
     quantized block runs on the quantized stream up to that group; hooks fold x_q (with its tail tags) and the
     matching x_fp into H_common / H_tail / H_delta; each Linear of the group is solved and its weight replaced by
     the lattice's exact value, so later groups see the quantization of earlier ones;
  3. both streams advance through their block.
The solvers (quant/tarq.py) return each Linear's lattice and the figures they computed; ``solve_layer``
(quant/layer_solve.py) turns those into the per-layer log record. After each block the lattice of its Linears and
the per-layer records are saved to a work directory (workdir.py), so an interrupted run resumes from the last
finished block: the streams are recomputed through the finished blocks (the same arithmetic as the uninterrupted
run), which gives the same final bytes. A block file that does not read back as
what was saved (its sha256 is kept in progress.json) is named in a warning, discarded and recomputed, together with
every block after it.

The backbone supplies stages (e.g. Whisper: encoder, decoder, output head) with their blocks and the code that moves
a window's hidden states into, through and out of them; see ``Stage`` (quant/backbone.py).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..quant.backbone import (STREAM_KIND, Block, Stage, StopForward, Window, finish_steps, input_hooks,
                              run_capturing_inputs, run_steps)
from ..quant.lattice import LatticeSpec, QuantizedWeight
from ..quant.layer_solve import LayerRecord, rows_of, rows_per_slice, solve_layer
from ..quant.precision import compute_in, full_precision, widened
from ..quant.recipe import TypeRecipe
from ..quant.stats import LayerStats
from ..quant.tarq import MetricCache, TarqConfig, importance_sums, reweighting_mask
from .workdir import WorkDir, WorkDirError

__all__ = ["CalibrationConfig", "CalibrationResult", "SequentialCalibrator"]


@dataclass
class CalibrationConfig:
    spec: LatticeSpec
    solver: TarqConfig
    device: str = "cpu"
    seed: int = 0
    recipe: TypeRecipe | None = None  # per-tensor lattices; None: ``spec`` for every weight
    # the forward passes' precision (precision.py): "float32", or "bfloat16" (an opt-in)
    compute_dtype: str = "float32"
    # imatrix: where each Linear's importance sums and count go (weight name -> (float32 [n_in], count)), for a
    # caller that saves them (quantize --save-imatrix); not a knob of the result
    importance_sink: dict[str, tuple[torch.Tensor, float]] | None = field(default=None, compare=False)

    def spec_for(self, name: str) -> LatticeSpec:
        return self.recipe.spec_for(name) if self.recipe is not None else self.spec


@dataclass
class CalibrationResult:
    lattice: dict[str, QuantizedWeight]  # full weight name ("<block>.<linear>.weight") -> lattice
    records: list[dict]
    seconds: float
    # with ``keep_streams_after``: each stream's per-window dicts as that stage left them (what a later run of the
    # stages after it starts from: SequentialCalibrator's ``streams``)
    streams: dict[str, list[dict]] | None = None


class SequentialCalibrator:
    """Runs the sweep over the stages of a backbone for a list of windows."""

    def __init__(self, stages: list[Stage], windows: list[Window], config: CalibrationConfig,
                 work_dir: WorkDir | None = None, log: Callable[[str], None] = print,
                 milestone: Callable[[str], None] | None = None,
                 streams: dict[str, list[dict]] | None = None, keep_streams_after: str | None = None) -> None:
        """``streams``: what earlier stages, calibrated by another run, left in each stream (a run of the stages
        after them: the lookup pass); ``keep_streams_after``: the stage after which the result keeps the streams."""
        self.stages = stages
        self.initial_streams = streams
        self.keep_streams_after = keep_streams_after
        self.windows = windows
        self.config = config
        self.device = torch.device(config.device)
        self.work_dir = work_dir
        self.log = log
        self.milestone = milestone or (lambda _: None)  # "block i/N" after each block: a cost benchmark's clock
        self.generator = torch.Generator().manual_seed(config.seed)
        self.masks = [self._reweighting_masks(w) for w in windows]
        self.paired = config.solver.uses_residual

    def _reweighting_masks(self, window: Window) -> dict[str, torch.Tensor]:
        return {domain: reweighting_mask(mask, self.config.solver.source, self.generator)
                for domain, mask in window.masks.items()}

    def _restore(self) -> tuple[int, list[dict]]:
        """The number of blocks finished by an earlier run that read back intact, and their records. The first
        block that does not is named in a warning and recomputed, with every block after it. Each is read here to
        check it and again when it is replayed, so that no more than one block's lattice is held at a time."""
        if self.work_dir is None:
            return 0, []
        try:
            finished, records = self.work_dir.load()
        except WorkDirError as e:
            self.log(f"warning: {e}; discarding the earlier progress and starting afresh")
            return 0, []
        blocks = self._blocks()
        intact = 0
        for index in range(min(finished, len(blocks))):
            try:
                self.work_dir.load_block(index, self.config.spec_for, blocks[index])
            except WorkDirError as e:
                self.log(f"warning: {e}; discarding it and recomputing from block {index} ({blocks[index].name})")
                break
            intact += 1
        n_records = sum(len(group) for block in blocks[:intact] for group in block.groups)
        if len(records) < n_records:
            self.log(f"warning: {self.work_dir.progress_file}: holds {len(records)} layer records, the finished "
                     f"blocks have {n_records}; discarding the earlier progress and starting afresh")
            return 0, []
        return intact, records[:n_records]

    def _blocks(self) -> list[Block]:
        return [block for stage in self.stages for block in stage.blocks]

    def _read_back(self) -> dict[str, QuantizedWeight]:
        """Every block's lattice from the work directory, once the streams and statistics are gone: a finished
        block's codes are not held through the sweep (large-v3's are 1.5 GB of int8)."""
        lattice: dict[str, QuantizedWeight] = {}
        for index, block in enumerate(self._blocks()):
            lattice.update(self.work_dir.load_block(index, self.config.spec_for, block))
        return lattice

    def run(self) -> CalibrationResult:
        with compute_in(self.config.compute_dtype, self.device):  # the solver and the statistics turn it off
            return self._run()

    def _run(self) -> CalibrationResult:
        start = time.perf_counter()
        finished, records = self._restore()
        lattice: dict[str, QuantizedWeight] = {}  # without a work directory: every block's, held to the end
        # The full-precision stream only feeds H_delta: methods without the residual step run the quantized stream
        # alone, as GPTQ itself does.
        kinds = ("fp", "q") if self.paired else ("q",)
        streams = {kind: [dict(s) for s in self.initial_streams[kind]] if self.initial_streams else
                   [{STREAM_KIND: kind} for _ in self.windows] for kind in kinds}
        kept_streams = None
        block_index = 0
        blocks_total = sum(len(s.blocks) for s in self.stages)
        progress = tqdm(total=blocks_total, desc="calibrating", unit="block", initial=finished)
        if finished:
            self.log(f"resuming after {finished} finished blocks")
        for stage in self.stages:
            self.constant_stats = {}  # statistics of stream tensors (e.g. the encoder output) for this stage
            # their prepared metrics: the decoder's cross-attention k/v of every block solve with the same statistics,
            # so the metric is damped, inverted and factored once per stage (large-v3: 32 times n = 1280 before)
            self.constant_metrics: MetricCache = {}
            h = {kind: [stage.enter(w, s) for w, s in zip(self.windows, streams[kind])] for kind in streams}
            for block in stage.blocks:
                if block_index < finished:
                    restored = self.work_dir.load_block(block_index, self.config.spec_for, block)
                    h = self._replay_block(stage, block, restored, h, streams)
                else:
                    block_lattice, block_records, h = self._calibrate_block(stage, block, h, streams)
                    records.extend(block_records)
                    if self.work_dir:
                        self.work_dir.save_block(block_index, block_lattice, records)
                    else:
                        lattice.update(block_lattice)
                    progress.update(1)
                block_index += 1
                self.milestone(f"block {block_index}/{blocks_total}")
            for kind in streams:
                for w, s, hidden in zip(self.windows, streams[kind], h[kind]):
                    stage.leave(hidden, w, s)
            if stage.name == self.keep_streams_after:  # copies of the dicts: later stages add their own keys
                kept_streams = {kind: [dict(s) for s in streams[kind]] for kind in streams}
        progress.close()
        del streams, h
        if self.work_dir:
            lattice = self._read_back()
        return CalibrationResult(lattice, records, time.perf_counter() - start, kept_streams)

    # -- one block -------------------------------------------------------------------------------------------------
    def _calibrate_block(self, stage: Stage, block: Block, h: dict[str, list[torch.Tensor]],
                         streams: dict[str, list[dict]]) -> tuple[dict[str, QuantizedWeight], list[dict], dict]:
        # The block is held in float32 while its Linears take lattice values and the streams pass through it (its
        # stored dtype may not hold s * q); afterwards nothing reads its weights again, so it is narrowed back.
        with widened(block.module):
            return self._calibrate_widened_block(stage, block, h, streams)

    def _calibrate_widened_block(self, stage: Stage, block: Block, h: dict[str, list[torch.Tensor]],
                                 streams: dict[str, list[dict]]) -> tuple[dict[str, QuantizedWeight], list[dict], dict]:
        x_fp, h_fp_next = None, None
        if self.paired:
            x_fp, h_fp_next = self._kept_fp_stream(block) or \
                self._capture_fp_inputs(stage, block, h["fp"], streams["fp"])
        lattice: dict[str, QuantizedWeight] = {}
        records: list[dict] = []
        programs = [stage.steps(block.module, hq, w, s) for hq, w, s in zip(h["q"], self.windows, streams["q"])] \
            if hasattr(stage, "steps") else None
        for group in block.groups:
            feed = self._stepped(programs, group) if programs else self._hooked(stage, block, group, h["q"], streams)
            stats = self._group_stats(block, group, x_fp, streams, feed)
            if x_fp is not None:  # folded into the statistics: the group's fp inputs are not needed again
                for inputs in x_fp:
                    for rel in group:
                        inputs.pop(rel, None)
            metrics: MetricCache = {}  # Linears of the group that share statistics share their prepared metric
            for rel in group:
                constant = any(stats[rel] is s for s in self.constant_stats.values())
                q, record = self._solve(block, rel, stats[rel], self.constant_metrics if constant else metrics)
                lattice[f"{block.full_name(rel)}.weight"] = q
                records.append(record.to_json())
        del x_fp
        h_q_next = [finish_steps(program) for program in programs] if programs else \
            [self._forward(stage, block.module, hq, w, s) for hq, w, s in zip(h["q"], self.windows, streams["q"])]
        return lattice, records, {"fp": h_fp_next, "q": h_q_next} if self.paired else {"q": h_q_next}

    def _hooked(self, stage: Stage, block: Block, group: list[str], h_q: list[torch.Tensor],
                streams: dict[str, list[dict]]) -> Callable[[int, Callable], None]:
        """Feeds a group's inputs by running the partly quantized block on a window with input hooks (stopped once
        the group's inputs are in)."""
        def feed(w_index: int, fold: Callable[[str, torch.Tensor], None]) -> None:
            with input_hooks(block.module, group, fold):
                self._forward(stage, block.module, h_q[w_index], self.windows[w_index], streams["q"][w_index])
        return feed

    @staticmethod
    def _stepped(programs: list, group: list[str]) -> Callable[[int, Callable], None]:
        """Feeds a group's inputs by advancing a window's step program to the group (Stage.steps)."""
        def feed(w_index: int, fold: Callable[[str, torch.Tensor], None]) -> None:
            with torch.no_grad():
                inputs = next(programs[w_index])
            if list(inputs) != group:
                raise RuntimeError(f"the block's steps yielded {list(inputs)}, its next group is {group}")
            for rel, x in inputs.items():
                fold(rel, x.detach().reshape(-1, x.shape[-1]))
        return feed

    def _replay_block(self, stage: Stage, block: Block, restored: dict[str, QuantizedWeight],
                      h: dict[str, list[torch.Tensor]], streams: dict[str, list[dict]]) -> dict:
        """Advance both streams through a block finished in an earlier run (fp first, then with its lattice)."""
        with widened(block.module):
            return self._replay_widened_block(stage, block, restored, h, streams)

    def _replay_widened_block(self, stage: Stage, block: Block, restored: dict[str, QuantizedWeight],
                              h: dict[str, list[torch.Tensor]], streams: dict[str, list[dict]]) -> dict:
        h_fp_next = None
        if self.paired:
            kept = self._kept_fp_stream(block)
            h_fp_next = kept[1] if kept else \
                [self._forward(stage, block.module, x, w, s) for x, w, s in zip(h["fp"], self.windows, streams["fp"])]
        for name, q in restored.items():
            rel = next(r for g in block.groups for r in g if f"{block.full_name(r)}.weight" == name)
            _assign(block.linear(rel), q)
        h_q_next = [self._forward(stage, block.module, x, w, s) for x, w, s in zip(h["q"], self.windows, streams["q"])]
        return {"fp": h_fp_next, "q": h_q_next} if self.paired else {"q": h_q_next}

    def _forward(self, stage: Stage, module: nn.Module, h: torch.Tensor, window: Window, stream: dict) -> torch.Tensor:
        with torch.no_grad():
            return stage.call_block(module, h, window, stream)

    def _kept_fp_stream(self, block: Block) -> tuple[list[dict], list[torch.Tensor]] | None:
        """(x_fp per window, the block's fp outputs) when every window kept them from the backbone's own pass (see
        ``Window.fp_stream``); taken out of the windows, so each is let go once the block is done."""
        kept = [window.fp_stream.pop(block.name, None) for window in self.windows]
        if any(entry is None for entry in kept):
            return None
        return [inputs for inputs, _ in kept], [output for _, output in kept]

    def _capture_fp_inputs(self, stage: Stage, block: Block, h_fp: list[torch.Tensor],
                           streams: list[dict]) -> tuple[list[dict], list[torch.Tensor]]:
        """Run the full-precision block once per window, keeping every Linear's input (x_fp) and the output. A stage
        with step programs runs them to their end, keeping what they yield: no group of the block is solved yet, so
        its weights are the full-precision ones, and no Linear runs whose output nothing reads (the head's logits).
        Otherwise a full-precision copy of the block runs with input hooks."""
        if hasattr(stage, "steps"):
            runs = [run_steps(stage.steps(block.module, hidden, window, stream))
                    for hidden, window, stream in zip(h_fp, self.windows, streams)]
            return [inputs for inputs, _ in runs], [output for _, output in runs]
        fp_module = copy.deepcopy(block.module)
        captured: list[dict[str, torch.Tensor]] = []
        outputs: list[torch.Tensor] = []
        for hidden, window, stream in zip(h_fp, self.windows, streams):
            inputs, output = run_capturing_inputs(fp_module, block.groups,
                                                  lambda: self._forward(stage, fp_module, hidden, window, stream))
            captured.append(inputs)
            outputs.append(output)
        return captured, outputs

    def _group_stats(self, block: Block, group: list[str], x_fp: list[dict] | None, streams: dict[str, list[dict]],
                     feed: Callable[[int, Callable[[str, torch.Tensor], None]], None]) -> dict[str, LayerStats]:
        """Have ``feed`` hand over the inputs of ``group`` on every window (the partly quantized block run up to the
        group) and fold them into stats.

        Two shortcuts, both exact: Linears fed the very same tensor (q/k/v of an attention, k/v of cross-attention)
        share one LayerStats; and a Linear fed a stream tensor that is fixed for the whole stage (the decoder's
        cross-attention k/v read the encoder output in every block) reuses the statistics the first block gathered."""
        stats = {rel: self._new_stats(block.linear(rel), len(group), x_fp is not None) for rel in group}
        shares: dict[str, str] = {}  # rel -> the rel whose statistics it shares, fixed on the first window
        sources: dict[str, tuple | None] = {}  # rel -> (stream key, domain) when its input is a stage constant
        for w_index in range(len(self.windows)):
            pending = set(group)
            seen: list[tuple[str, torch.Tensor]] = []  # held, so no address is reused within this forward

            def fold(rel: str, x_q: torch.Tensor) -> None:
                twin = next((r for r, x in seen if _same_tensor(x, x_q)
                             and block.domain_of(r) == block.domain_of(rel)), None)
                source = self._stream_source(rel, block, x_q, x_fp, w_index, streams)
                if w_index == 0:
                    shares.update({rel: twin} if twin is not None else {})
                    sources[rel] = source
                if shares.get(rel) != twin or sources[rel] != source:
                    raise RuntimeError(f"{block.full_name(rel)}: window {w_index} feeds it differently from the first")
                if twin is None and source not in self.constant_stats:
                    mask = self.masks[w_index][block.domain_of(rel)]
                    stats[rel].add(x_q, mask, x_fp[w_index][rel] if x_fp is not None else None)
                seen.append((rel, x_q))
                pending.discard(rel)
                if not pending:
                    raise StopForward

            try:
                feed(w_index, fold)
            except StopForward:
                pass
        for rel, source in sources.items():
            if source is not None:
                stats[rel] = self.constant_stats.setdefault(source, stats[rel])
        for rel, owner in shares.items():
            stats[rel] = stats[owner]
        return stats

    def _new_stats(self, linear: nn.Linear, group_size: int, paired: bool) -> LayerStats:
        """Statistics for a Linear; a lone Linear with fewer outputs than inputs (fc2) gathers W H_delta itself,
        which is cheaper than H_delta (stats.py). Its weight is that of the solve: a group is solved after its
        statistics are complete."""
        narrow = paired and group_size == 1 and linear.out_features < linear.in_features
        return LayerStats(linear.in_features, device=self.device,
                          projection=linear.weight.detach() if narrow else None)

    def _stream_source(self, rel: str, block: Block, x_q: torch.Tensor, x_fp: list[dict] | None, w_index: int,
                       streams: dict[str, list[dict]]) -> tuple | None:
        """(stream key, domain) when x_q is a tensor of the window's quantized stream (and x_fp the same key of its
        fp stream): such an input is the same in every block of the stage."""
        for key, value in streams["q"][w_index].items():
            if torch.is_tensor(value) and value.dim() > 0 and _same_tensor(value.reshape(-1, value.shape[-1]), x_q):
                if x_fp is None or _same_or_equal(streams["fp"][w_index][key].reshape(-1, value.shape[-1]),
                                                  x_fp[w_index][rel]):
                    return key, block.domain_of(rel)
        return None

    def _solve(self, block: Block, rel: str, stats: LayerStats,
               metrics: MetricCache | None = None) -> tuple[QuantizedWeight, LayerRecord]:
        with full_precision(self.device):  # run() leaves autocast on for the forward passes
            linear, name = block.linear(rel), block.full_name(rel)
            W = linear.weight.detach().to(self.device, torch.float32)
            q, record = solve_layer(name, W, stats, self.config.spec_for(f"{name}.weight"), self.config.solver,
                                    identity_weight=block.identity_weight, metrics=metrics)
            if self.config.importance_sink is not None:
                sums, count = importance_sums(stats)
                self.config.importance_sink[f"{name}.weight"] = (sums.cpu(), float(count))
            if self.config.solver.sequential:
                _assign(linear, q)
            return q.to("cpu"), record


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _same_or_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor, or one of equal values: a stream tensor the backbone's own pass computed for a kept fp
    stream (Window.fp_stream) is a copy of the one the driver's stream holds, value for value."""
    return _same_tensor(a, b) or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def _assign(linear: nn.Linear, q: QuantizedWeight) -> None:
    """Replace a Linear's weight by the lattice's exact value (in place, so tied parameters follow), a slice of rows
    at a time (a head's whole dequantized copy is 1.2 GB)."""
    rows = rows_per_slice(q.shape[1])
    with torch.no_grad():
        for start in range(0, q.shape[0], rows):
            part = rows_of(q, slice(start, start + rows)).dequantize()
            linear.weight[start:start + rows].copy_(part.to(linear.weight.device, linear.weight.dtype))


