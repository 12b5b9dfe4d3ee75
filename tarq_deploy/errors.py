"""Errors that describe bad user input; the CLI prints them without a traceback and exits with status 2."""

import math

__all__ = ["CalibrationDataError", "JSON_ERRORS", "NonFiniteError", "UserError", "all_finite", "nonfinite_problem",
           "require_finite"]


# What json.loads raises on bad bytes: ValueError (not UTF-8, not JSON, an integer past Python's digit limit) and
# RecursionError (arrays or objects nested thousands deep). Every reader of a JSON file it did not write catches these.
JSON_ERRORS = (ValueError, RecursionError)


class UserError(Exception):
    """An error caused by the user's input (the message names the file or option and the problem)."""


class NonFiniteError(UserError, ValueError):
    """A weight or a calibration statistic holds NaN or Inf; the message names the tensor."""


class CalibrationDataError(UserError, ValueError):
    """Too little calibration data for a layer (no positions reached it); the message names the layer."""


def all_finite(tensor) -> bool:
    """Whether a floating-point torch tensor holds no NaN or Inf. Its sum is finite when it does (one pass, no
    mask); a sum that overflows (or a NaN or Inf) sends it to the element-wise check, which decides."""
    return math.isfinite(float(tensor.detach().sum())) or bool(tensor.isfinite().all())


def nonfinite_problem(tensor) -> str | None:
    """'3 NaN and 1 Inf values of 4096' when ``tensor`` (a torch tensor) is not all finite, else None. Takes the
    tensor's own methods, so this module imports nothing heavy."""
    if not tensor.is_floating_point() or all_finite(tensor):
        return None
    nan = int(tensor.isnan().sum())
    inf = int(tensor.isinf().sum())
    return f"{nan} NaN and {inf} Inf values of {tensor.numel()}"


def require_finite(name: str, tensor, what: str = "") -> None:
    """Raise NonFiniteError naming ``name`` when ``tensor`` holds NaN or Inf."""
    problem = nonfinite_problem(tensor)
    if problem is not None:
        raise NonFiniteError(f"{name}: {problem}{what}")
