"""Token mixers other than attention (linear attention, Mamba-2, short convolutions): each runs a shared prompt or trie
node once and its children from its final state, one registered unit per layer family."""

from turbogrpo.mixers import gated_delta, mamba2, short_conv  # noqa: F401 (each module registers its units)
from turbogrpo.mixers.forest import SegmentForest, path_conv, scan_levels
from turbogrpo.mixers.registry import MIXERS, MixerUnit, mixer_of, padding_reaches_state, register_mixer

__all__ = ["MIXERS", "MixerUnit", "SegmentForest", "mixer_of", "padding_reaches_state", "path_conv", "register_mixer",
           "scan_levels"]
