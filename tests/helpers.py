"""What several test modules share, defined once: the in-process CLI run, the options a quantize would build, and
the fixtures' small builders. Test modules import from here, never from one another."""

from __future__ import annotations

from typing import Any

from tarq_deploy.calibration.options import QuantizeArguments, QuantizeOptions
from tarq_deploy.model_source import resolve_source


def quantize_options_for(model: str = "packaged:base", **given: Any) -> QuantizeOptions:
    """The options `tarq-deploy quantize --model MODEL ...` builds (the schema's own rules and defaults), without
    loading the model; a method that calibrates is given a placeholder --calib unless one is named."""
    given.setdefault("calib", None if given.get("method") in ("rtn", "ggml") else "calib.jsonl")
    return QuantizeOptions.build(QuantizeArguments(model=model, **given), resolve_source(model), log=lambda _: None)
