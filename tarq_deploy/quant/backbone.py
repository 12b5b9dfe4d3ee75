"""The backbone contract: what a model adapter (models/whisper.py, voxtral.py, qwen3_asr.py) hands the sequential
calibration (calibration/driver.py) -- windows with their tail tags, blocks of Linears in true-sequential order,
and stages that move a window's hidden states into, through and out of their blocks -- plus the hooks both sides
use to read a Linear's input during a forward pass. No solver and no I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

__all__ = ["STREAM_KIND", "Window", "Block", "Stage", "StopForward", "finish_steps", "run_steps", "run_capturing_inputs",
           "input_of", "input_hooks"]

# Each stream dict a stage sees names its stream under this key ("fp" or "q"): a stage may compute the quantized
# stream's entry otherwise than the runtime-free fp one (Whisper's decoder lookup, ``lookup pass``).
STREAM_KIND = "stream"


@dataclass
class Window:
    """One calibration input: what the backbone needs to run it, and tail tags per position domain."""

    inputs: dict[str, torch.Tensor]
    masks: dict[str, torch.Tensor]  # domain ("frames", "tokens") -> bool [positions]
    info: dict[str, Any] = field(default_factory=dict)
    # The full-precision stream through blocks the backbone already ran while building the window (Whisper's
    # alignment pass runs the whole fp encoder and decoder): block name -> (its Linears' inputs x_fp, its output).
    # The driver takes an entry instead of running that fp block again; the values are those the run would compute.
    fp_stream: dict[str, tuple[dict[str, torch.Tensor], torch.Tensor]] = field(default_factory=dict, repr=False)


@dataclass
class Block:
    """A unit of the sequential sweep: a module whose Linears are solved together before the streams advance."""

    name: str  # state-dict prefix of the module, e.g. "model.encoder.layers.3"
    module: nn.Module
    groups: list[list[str]]  # Linear names relative to ``module``, in true-sequential order
    domain: str = "tokens"  # position domain of the block's activations
    domain_overrides: dict[str, str] = field(default_factory=dict)  # e.g. cross-attention k/v read encoder frames
    identity_weight: float = 0.0  # mu: adds mu * tr(H_common)/n * I to the metric (see Whisper's tied head)

    def full_name(self, rel: str) -> str:
        """State-dict name of a Linear of this block (without the ".weight")."""
        return f"{self.name}.{rel}" if self.name else rel

    def weight_names(self) -> list[str]:
        """State-dict names of the weights this block calibrates, in group order."""
        return [f"{self.full_name(rel)}.weight" for group in self.groups for rel in group]

    def linear(self, rel: str) -> nn.Linear:
        return self.module.get_submodule(rel)  # type: ignore[return-value]

    def domain_of(self, rel: str) -> str:
        return self.domain_overrides.get(rel, self.domain)


class Stage(Protocol):
    """A run of blocks sharing one way of entering and leaving (encoder, decoder, head)."""

    name: str
    blocks: list[Block]

    def enter(self, window: Window, stream: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states entering the first block; ``stream`` holds what earlier stages left (per stream)."""

    def call_block(self, module: nn.Module, h: torch.Tensor, window: Window, stream: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one block of this stage."""

    def leave(self, h: torch.Tensor, window: Window, stream: dict[str, torch.Tensor]) -> None:
        """Store the stage's output in ``stream`` for later stages."""

    # Optional: ``steps(module, h, window, stream)``, a generator that runs one block as ``call_block`` does, but
    # yields before each group of Linears ({name: input}, in the block's group order and, within a group, in the
    # order the block calls them) and returns the block's output. The driver then runs each window through a block
    # once, solving each group between the steps, instead of running the block again up to every group.

class StopForward(Exception):
    """Raised from a hook once the inputs of the current group are captured: the rest of the block is not needed."""


def finish_steps(program) -> torch.Tensor:
    """Run a step program to its end; its return value is the block's output."""
    with torch.no_grad():
        try:
            next(program)
        except StopIteration as done:
            return done.value
    raise RuntimeError("a block's steps yielded more groups than the block has")


def run_steps(program) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(every Linear's input as the step program yields it, flattened to [positions, n]; the block's output)."""
    inputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        while True:
            try:
                group = next(program)
            except StopIteration as done:
                return inputs, done.value
            inputs.update({rel: x.detach().reshape(-1, x.shape[-1]) for rel, x in group.items()})



def run_capturing_inputs(module: nn.Module, groups: list[list[str]],
                         run: Callable[[], torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(every named Linear's input, flattened to [positions, n]; the output) of ``run()``, a forward of ``module``
    (the fp stream through a block: what a backbone computing it ahead of the driver keeps, see Window.fp_stream)."""
    inputs: dict[str, torch.Tensor] = {}
    with input_hooks(module, [rel for group in groups for rel in group], inputs.__setitem__):
        output = run()
    return inputs, output


def input_of(linear: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The input ``linear`` receives while ``run()`` runs, which stops there (the rest is not computed): for a step
    program, the part of a module's forward up to one of its Linears, computed by the module's own code."""
    captured: list[torch.Tensor] = []

    def hook(_module: nn.Module, args: tuple) -> None:
        captured.append(args[0])
        raise StopForward

    handle = linear.register_forward_pre_hook(hook)
    try:
        run()
    except StopForward:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(linear).__name__} was not called")
    return captured[0]


class input_hooks:
    """Context manager: forward pre-hooks that hand each named Linear's input (flattened to [positions, n]) to ``sink``."""

    def __init__(self, module: nn.Module, names: list[str], sink: Callable[[str, torch.Tensor], None]) -> None:
        self.handles = []
        for rel in dict.fromkeys(names):
            linear = module.get_submodule(rel)
            self.handles.append(linear.register_forward_pre_hook(self._hook(rel, sink)))

    @staticmethod
    def _hook(rel: str, sink: Callable[[str, torch.Tensor], None]) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0]
            sink(rel, x.detach().reshape(-1, x.shape[-1]))
        return hook

    def __enter__(self) -> "input_hooks":
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

