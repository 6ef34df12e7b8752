"""Speculative rollouts: an EAGLE-style draft head proposes token trees that the policy verifies.

    from turbogrpo.speculative import DraftHead, Speculation, generate_speculative
    draft = DraftHead.load("runs/draft", model)          # or DraftHead(model) + train_draft(...)
    rollout = generate_speculative(model, prompts, num_samples=8, sampling=sampling, draft=draft)
    rollout.stats.tree_sizes, rollout.stats.accepted_lengths   # per decoding step

``verify`` (lossless acceptance), ``tree`` (EAGLE-2 dynamic trees), ``draft`` (the draft head),
``draft_training`` (its training, offline and online), ``history`` (suffix-match drafts from siblings
and earlier rollouts, no neural forward), ``draft_decoding`` (the draft's cache and forwards while
decoding), ``sizing``/``profiler`` (concurrency-aware tree sizing), ``speculation`` (the
``Speculation`` a rollout is given), ``decode`` (the tree step that the rollout engine's loop runs) and
``multiturn`` (speculation inside multi-turn rollouts, through
``generate_multiturn(..., draft=Speculation(...))``).
"""

from turbogrpo.speculative.decode import SpeculativeStats, TreeStep
from turbogrpo.speculative.speculation import Speculation, generate_speculative
from turbogrpo.speculative.draft import DraftConfig, DraftHead
from turbogrpo.speculative.draft_training import DraftGroup, DraftTrainConfig, draft_groups, train_draft
from turbogrpo.speculative.history import HistoryDrafts, HistoryStore
from turbogrpo.speculative.profiler import LatencyCurve, LatencyProfile, cached_profile, profile_latency
from turbogrpo.speculative.sizing import SIZING_POLICIES, SizingPolicy, make_sizing
from turbogrpo.speculative.tree import TreeShape

__all__ = ["DraftConfig", "DraftGroup", "DraftHead", "DraftTrainConfig", "HistoryDrafts", "HistoryStore",
           "LatencyCurve", "LatencyProfile",
           "SIZING_POLICIES", "SizingPolicy", "Speculation", "SpeculativeStats", "TreeShape", "cached_profile",
           "TreeStep", "draft_groups", "generate_speculative", "make_sizing", "profile_latency", "train_draft"]
