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


class OutputError(ConfigError):
    """Results could not be written (disk full, permissions); nothing partial is left."""
