"""What the training forward shares between a micro-batch's sequences (train.sharing), one entry per choice.

Each choice is a forward ``fn(model, prompts, completions, *, backend, temperature, ...) ->
CompletionLogprobs`` (the trainer's, the reference's and the old policy's) and how micro-batches count
tokens against train.micro_batch_tokens. Every choice gives the same log-probs and gradients; they
differ in how many tokens the decoder runs.

* ``prompt``: each group's prompt runs once, every completion whole (``turbogrpo.prefix``); micro-batches
  count ``P + sum(S_i)`` per group.
* ``tree``: each micro-batch's groups as one trie (``turbogrpo.tree.completions``): completions that
  begin alike (siblings, conversations sharing earlier turns) share those tokens too; micro-batches
  count trie tokens and split at group or completion boundaries (a completion's path is never cut).
* ``auto``: per micro-batch, the tree when its trie saves enough tokens
  (``tree.completions.AUTO_MIN_SAVED``), else the prompt path; micro-batches are planned as for
  ``prompt``, so the budget holds whichever runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from turbogrpo.batch import Groups
from turbogrpo.prefix import compute_logprobs
from turbogrpo.tree.completions import compute_auto_logprobs, compute_tree_logprobs
from turbogrpo.tree.trie import common_prefix_lengths


class Sharing(NamedTuple):
    forward: Callable
    """``fn(model, prompts, completions, *, backend, temperature, **options) -> CompletionLogprobs``."""
    counts_trie_tokens: bool
    """Micro-batches count the trie's tokens (completions' common starts once) instead of whole completions."""

    def micro_batches(self, batch: Groups, token_budget: int) -> list[Groups]:
        """``batch`` cut by ``token_budget`` tokens as this forward counts them (``Groups.micro_batches``)."""
        if not self.counts_trie_tokens:
            return batch.micro_batches(token_budget)
        return batch.micro_batches(token_budget, [common_prefix_lengths(group) for group in batch.nested()])


SHARINGS: dict[str, Sharing] = {
    "prompt": Sharing(partial(compute_logprobs, share_prefix=True), counts_trie_tokens=False),
    "tree": Sharing(compute_tree_logprobs, counts_trie_tokens=True),
    "auto": Sharing(compute_auto_logprobs, counts_trie_tokens=False),
}


def sharing_of(name: str) -> Sharing:
    if name not in SHARINGS:
        raise ValueError(f"unknown sharing {name!r}; one of {', '.join(SHARINGS)}")
    return SHARINGS[name]
