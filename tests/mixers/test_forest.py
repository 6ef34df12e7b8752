"""The segment forest by hand: its taps, its level scan and its path convolution on a small forest, and known-wrong
state passing that the parity check must catch."""

import pytest
import torch
import torch.nn.functional as F

from tests.mixers.conftest import build_hybrid
from tests.mixers.test_parity import prefix_errors, tree_errors
from turbogrpo.mixers import SegmentForest, gated_delta, path_conv, scan_levels

# A root of 3 tokens with two children (2 tokens, 1 token), the second with a child of 1 token:
#   0 1 2 ─┬─ 3 4
#          └─ 5 ── 6
FOREST = dict(starts=[0, 3, 5, 6], lengths=[3, 2, 1, 1], parents=[-1, 0, 0, 2])
PATHS = [[0, 1, 2, 3, 4], [0, 1, 2, 5], [0, 1, 2, 5, 6]]   # every root-to-node path that ends at a leaf


def forest():
    return SegmentForest.build(**FOREST, device=torch.device("cpu"))


def test_taps_follow_each_tokens_path_back_to_its_root():
    taps = forest().taps(3)
    assert taps.tolist() == [[-1, -1, 0], [-1, 0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [1, 2, 5], [2, 5, 6]]


def test_levels_hold_each_depths_segments_as_blocks_of_padded_rows():
    """Blocks by length (powers of two), shortest first; a level's rows are its blocks' in turn."""
    levels = forest().levels
    assert [[block.rows.tolist() for block in level] for level in levels] == [[[[0, 1, 2]]], [[[5]], [[3, 4]]],
                                                                              [[[6]]]]
    assert levels[0][0].parent_rows is None
    assert [block.parent_rows.tolist() for block in levels[1]] == [[0], [0]]
    assert levels[2][0].parent_rows.tolist() == [0]   # segment 3's parent (segment 2) is row 0 of level 1
    # Lengths 3 and 4 share a block (padding at most doubles a row), 1 has its own.
    (roots,), (ones, threes_and_fours) = SegmentForest.build([0, 2, 5, 9], [2, 3, 4, 1], [-1, 0, 0, 0],
                                                             torch.device("cpu")).levels
    assert ones.rows.tolist() == [[9]] and threes_and_fours.rows.tolist() == [[2, 3, 4, 0], [5, 6, 7, 8]]
    assert threes_and_fours.valid.tolist() == [[True, True, True, False], [True] * 4]


def running_sum(x, *, valid, initial_state):
    """A recurrence whose state is the sum so far (pads add nothing)."""
    x = x * valid
    out = x.cumsum(1) + (0 if initial_state is None else initial_state[0][:, None])
    return out, (out[:, -1],)


def test_scan_carries_each_segments_final_state_to_its_children():
    x = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    out = scan_levels(forest(), (x,), running_sum)
    expected = torch.empty(7)
    for path in PATHS:
        expected[path] = x[path].cumsum(0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_path_conv_is_a_causal_conv1d_along_every_path():
    torch.manual_seed(0)
    channels, width = 5, 3
    x, weight, bias = torch.randn(7, channels), torch.randn(channels, width), torch.randn(channels)
    out = path_conv(x, forest().taps(width), weight, bias)
    for path in PATHS:
        along = F.conv1d(x[path].T[None], weight[:, None], bias, padding=width - 1, groups=channels)[0, :, :len(path)]
        torch.testing.assert_close(out[path], along.T, rtol=0, atol=1e-6)


def test_path_conv_gradients_are_its_own_derivatives():
    """Its backward (hand-written, recomputing each tap's gather) against finite differences, zero taps included."""
    torch.manual_seed(0)
    x, weight = torch.randn(7, 3, dtype=torch.float64, requires_grad=True), torch.randn(3, 4, dtype=torch.float64,
                                                                                         requires_grad=True)
    taps = forest().taps(4)
    assert torch.autograd.gradcheck(lambda x, w: path_conv(x, taps, w, None), (x, weight))


def wrong_steps():
    step = gated_delta.delta_rule_rows

    def from_zero(kernel, *rows, valid, initial_state):
        return step(kernel, *rows, valid=valid, initial_state=None)

    def pads_decay(kernel, query, key, value, g, beta, *, valid, initial_state):
        return step(kernel, query, key, value, g, beta, valid=torch.ones_like(valid), initial_state=initial_state)

    def detached(kernel, *rows, valid, initial_state):
        return step(kernel, *rows, valid=valid,
                    initial_state=None if initial_state is None else tuple(s.detach() for s in initial_state))
    return {"from_zero": from_zero, "pads_decay": pads_decay, "detached": detached}


@pytest.mark.parametrize("wrong", ["from_zero", "pads_decay", "detached"])
def test_known_wrong_state_passing_fails_the_parity_check(monkeypatch, float64_throughout, wrong):
    """Children from the zero state, pad slots that decay and write the state, a detached shared state: each must
    show in the log-probs or the gradients (prompts of 5, 11 and 3 tokens: the shorter rows have pads)."""
    monkeypatch.setattr(gated_delta, "delta_rule_rows", wrong_steps()[wrong])
    model = build_hybrid("qwen3_5_text")
    worst = max(max(prefix_errors(model, "mixed", backend="cascade")),
                max(tree_errors(model, "deep-narrow", backend="cascade")))
    assert worst > 1e-6
