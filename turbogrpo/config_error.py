"""The error of a bad config value, in a module of its own so that every layer can raise it: ``config``
re-exports it, and the data layer names a key in one when the run's settings leave no room for a prompt."""


class ConfigError(ValueError):
    """A bad config value; the message names the key (``section.field``) and what is allowed."""
