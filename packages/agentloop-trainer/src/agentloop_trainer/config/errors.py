"""The one error a config raises."""


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and the fix."""
