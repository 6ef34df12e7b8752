"""Ranks that agree: under ``torchrun`` every rank reads its own config file, data and model, so before
anything is built they compare what they will train with, and refuse to start when it differs.

A rank with another ``optim.lr`` or reward weight would step its optimizer differently (DDP averages the
gradients, not the updates), another ``data.num_train_problems`` or other rows would draw overlapping or
different prompts, and another ``rollout.num_generations`` would die later in a collective with gloo's
"Connection reset by peer". The check is one all-gather of a 32-byte hash of every rank's training keys;
only when the hashes differ do the ranks gather the keys themselves (``all_gather_object``), to name the
first that differs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as torch_dist

from turbogrpo.placement import DistInfo
from turbogrpo.train.distributed import all_gather_cat
from turbogrpo.train.output_dir import RunRecord

# Keys a rank may hold on its own: they change how it computes or what rank 0 logs, not what it trains.
RANK_LOCAL_KEYS = ("train.num_threads", "log")
CONTENT = "the content of "
"""Prefix of an input's fingerprint among the training keys (``the content of data.path``)."""


class RanksDisagree(ValueError):
    """The ranks do not train with the same settings; every rank raises the same line, and ``report`` is
    True on rank 0 alone, the one that prints it."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


def training_keys(record: RunRecord) -> dict[str, Any]:
    """What this rank trains with, in config order: every config key but ``RANK_LOCAL_KEYS`` (lists and
    tables flattened too: ``rewards.0.weight``), then a fingerprint of each local input it reads and
    trains on (``the content of data.path``, ``... model.path``; None for a built-in task or a Hub id)."""
    keys = {key: value for key, value in _flatten(record.config).items()
            if not any(key == local or key.startswith(local + ".") for local in RANK_LOCAL_KEYS)}
    keys.update({CONTENT + key: value for key, value in record.fingerprints.items()})
    return keys


def check_ranks_agree(record: RunRecord, dist: DistInfo) -> None:
    """RanksDisagree (a ValueError) on every rank, naming the first training key whose value differs
    between ranks (with each rank's value), when they do not all train with the same config and inputs.
    Every rank must call it."""
    if not dist.enabled:
        return
    keys = training_keys(record)
    digest = hashlib.sha256(json.dumps(list(keys.items()), default=repr).encode()).digest()
    hashes = all_gather_cat(torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(dist.device), dist)
    if bool((hashes.view(dist.world_size, -1) == hashes[:len(digest)]).all()):  # host sync, once per run
        return
    every_rank: list[dict[str, Any] | None] = [None] * dist.world_size
    torch_dist.all_gather_object(every_rank, keys)
    raise RanksDisagree(describe_first_difference(every_rank), report=dist.is_main)


def describe_first_difference(every_rank: list[dict[str, Any]]) -> str:
    """One line naming the first key (in rank 0's order, then the others') whose value is not the same on
    every rank, and the value of each rank."""
    order = list(dict.fromkeys(key for keys in every_rank for key in keys))
    missing = object()
    for key in order:
        values = [keys.get(key, missing) for keys in every_rank]
        if any(value != values[0] for value in values):
            break
    else:
        raise AssertionError("the ranks' training keys hash differently but are equal")
    shown = ", ".join(f"rank {rank} {'has none' if value is missing else repr(value)}"
                      for rank, value in enumerate(values))
    what = (f"{key} (its fingerprint)" if key.startswith(CONTENT) else f"config key {key!r}")
    return (f"the {len(every_rank)} ranks do not train with the same settings: {what} differs ({shown}); every "
            "rank must read the same config and inputs, or the ranks' updates and data shards would silently "
            "differ. Give every rank the same config file, --set options and files")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested tables and lists to dotted keys, as --set names them (``optim.lr``, ``rewards.0.weight``)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None or not tree:
        return {prefix.removesuffix("."): tree}
    flat = {}
    for name, value in items:
        flat.update(_flatten(value, f"{prefix}{name}."))
    return flat
