"""Errors the runner reports as one clear line (no traceback unless `runner.debug=true`)."""


class ConfigError(ValueError):
    """A bad key, value, name, path or combination, found before (or instead of) doing work.

    The message names the offending key or file and what is allowed.
    """


class BudgetViolation(RuntimeError):
    """A KV method held more tokens than its declared budget, or silently did nothing."""


class UnsupportedCombination(ConfigError):
    """A valid setting this method cannot take (e.g. a budget for the full cache): a sweep skips
    the combination with a one-line reason instead of failing."""


class UnsupportedReason(str):
    """A check's reason that names a valid setting this model cannot take (a budget below what
    the method's fixed heads hold on it), not a bad input: a setting refused only for such
    reasons is an `UnsupportedCombination` (a sweep skips it; a single run still exits with
    the line)."""


class OutputError(ConfigError):
    """Results could not be written (disk full, permissions); nothing partial is left."""
