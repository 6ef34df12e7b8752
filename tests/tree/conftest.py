"""Random tries for the tree tests, and the one-row-per-sequence truth they are checked against."""

import torch

from tests.prefix.conftest import VOCAB

# Trie shapes (levels below the root, fan-out range, run-length range per level): depth 1-5, fan-out
# 1-4, shared runs from 1 token to hundreds. Every path fits the test models' 256 positions.
TRIE_SHAPES = {
    "deep-narrow": dict(levels=5, fanout=(1, 2), runs=[(2, 9)] * 6),
    "wide": dict(levels=1, fanout=(4, 4), runs=[(3, 12), (1, 20)]),
    "one-token-runs": dict(levels=4, fanout=(1, 3), runs=[(1, 1)] * 5),
    "long-shared": dict(levels=2, fanout=(2, 4), runs=[(200, 200), (5, 30), (1, 20)]),
}


def random_sequences(levels, fanout, runs, seed=0, max_sequences=14):
    """Sequences of a random tree: root-to-leaf paths, plus some paths that end at an inner node."""
    g = torch.Generator().manual_seed(seed)

    def randint(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=g))

    sequences = []

    def grow(prefix, level):
        run = torch.randint(0, VOCAB, (randint(*runs[level]),), generator=g)
        path = torch.cat([prefix, run])
        if level == levels or len(sequences) >= max_sequences:
            if path.numel() >= 2:
                sequences.append(path)
            return
        if level > 0 and path.numel() >= 2 and randint(0, 4) == 0:
            sequences.append(path)   # a conversation that stopped at this turn
        for _ in range(randint(*fanout)):
            grow(path, level + 1)

    grow(torch.zeros(0, dtype=torch.long), 0)
    return sequences


def random_masks_and_weights(sequences, seed=0):
    """Loss masks with unscored runs (tool outputs) and a scored last token; uneven weights."""
    g = torch.Generator().manual_seed(seed + 1)
    masks, weights = [], []
    for s in sequences:
        mask = torch.rand(s.numel(), generator=g) < 0.7
        mask[0], mask[-1] = False, True
        masks.append(mask)
        weights.append(torch.randn(s.numel(), generator=g, dtype=torch.float64))
    return masks, weights


def per_sequence_truth(model, sequences, masks, temperature=1.0):
    """Log-probs of every loss token from the model's own forward of each sequence alone, flat."""
    logps = []
    for s, m in zip(sequences, masks):
        logits = model(s[None]).logits[0] / temperature
        positions = torch.nonzero(m).squeeze(1)
        logps.append(torch.log_softmax(logits.double() if logits.dtype == torch.float64 else logits, -1)[
            positions - 1, s[positions]])
    return torch.cat(logps)
