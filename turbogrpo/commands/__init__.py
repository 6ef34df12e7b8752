"""Command-line commands beside ``turbogrpo.cli``'s own: the draft head's (``draft``, ``draft_build``). They sit at
the top with the CLI, since they build runs' parts from a config as ``turbogrpo train`` does."""
