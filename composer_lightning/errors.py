"""The library's own errors: what the command line reports in one line instead of a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """Parts of the configuration that disagree, found once the trainer is set up (e.g. the
    module's and the sampling temperature); raised before any engine starts."""
