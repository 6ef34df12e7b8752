"""Concurrency-aware tree sizing: how big a tree each live sequence gets at each step.

Every policy is a small class in ``SIZING_POLICIES``; ``make_sizing(name, ...)`` builds one.

* ``off``: never speculate (plain decoding through the speculative loop).
* ``fixed``: the same tree shape at every step.
* ``fastgrpo``: FastGRPO's rule. With B live sequences each gets ``N = C_peak // B`` verify tokens,
  ``K = min(N - 1, K_max)``, ``L = min(floor(log2(N / alpha)), L_max)``. Unlike the reference code,
  ``C_peak`` comes from the measured latency curve, L has no lower floor beyond 1 (a floor wastes
  draft steps at high B), and B > C_peak / 2 (N < 2) turns speculation off instead of taking log2(0).
* ``cost``: ours. It predicts tokens per second for every shape (K, L, N) and for no tree, and picks
  the best. A step yields ``B * (1 + E[accepted])`` tokens in ``t_draft(B, K, L) + t_verify(B * N)``
  seconds, both read off the measured latency curves. ``E[accepted]`` is the sum over the tree's
  nodes of the probability that the path to the node is accepted; the policy models the probability
  that the policy's draw matches the draft's rank-r child at depth d as ``a[d, r]``, estimated from
  every verified tree of this rollout (and earlier ones: the policy object keeps its counts), and
  builds the same top-K-per-level tree that ``build_tree`` builds, with those probabilities.
  Speculation is off wherever the best tree does not beat plain decoding by ``margin``; trees stay
  within the measured range of the curves (B * N <= the largest profiled count). While off, every
  ``EXPLORE_EVERY``-th step still verifies the best tree (once the draft has read the prompts), so
  the acceptance statistics follow the text (a draft that was poor on one stretch can be good on the
  next). The first tree of a rollout also pays for the draft's prompt pass, so speculation starts
  only where the expected saving over the rollout's expected remaining steps (read off the completion
  lengths of earlier rollouts) repays that measured cost. What the curves miss (Python and
  bookkeeping around the forwards, a machine busier than when profiled) is learnt from the measured
  time of every step, as one scale factor for plain and one for tree steps. One factor cannot fit
  every live batch and shape, so the policy also keeps the *realised* gain of its trees per live-batch
  bucket (powers of two): the tokens its tree steps emitted per second over what plain steps give at
  that B (the curve at B times the plain steps' measured scale in that bucket), as a ratio of
  decayed sums over the bucket's recent tree steps (leaving out the draft's catch-up on the backlog
  that plain steps before a tree left: an exploratory tree pays for the whole plain streak, a cost
  of switching on, not of a tree step). Where that has fallen below 1 over at
  least ``MIN_REALISED`` tree steps, trees are vetoed there whatever the model predicts (still
  explored every ``EXPLORE_EVERY``-th step, so the veto lifts if the draft gets better): the guard
  behind "never slower than off".

``MergedSizing`` (not a registered name: ``history.speculation_sizing`` builds it for a neural draft
merged with history drafts) holds one policy per kind of tree and takes, each step, the one predicting
the larger gain (``predicted_gain``).

Policies see verification results through ``feedback`` (device tensors, returned in the step's one
host transfer) and ``observe`` (the same numbers on the host).
"""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

import torch

from turbogrpo.speculative.profiler import LatencyProfile
from turbogrpo.speculative.tree import DraftTree, TreeShape
from turbogrpo.speculative.verify import TreeVerdict

DEFAULT_K_MAX = 8
DEFAULT_L_MAX = 6
DEFAULT_N_MAX = 64


class SizingPolicy:
    """Chooses each step's tree shape from the number of live sequences."""

    name: ClassVar[str]

    def bounds(self) -> tuple[int, int]:
        """(most nodes a tree can have, most draft slots a tree's levels write): buffer sizes."""
        raise NotImplementedError

    def choose(self, num_live: int, *, draft_ready: bool = True, position: int = 0) -> TreeShape | None:
        """The tree for this step, or None for a plain step. ``draft_ready``: the draft has read this
        rollout's prompts (False: a first tree would also pay for that prompt pass). ``position``:
        tokens generated so far by the furthest live sequence."""
        raise NotImplementedError

    def predicted_gain(self, num_live: int) -> float:
        """Predicted token rate of this policy's tree at ``num_live`` over plain decoding's (1.0: no
        prediction)."""
        return 1.0

    def feedback(self, tree: DraftTree, verdict: TreeVerdict) -> torch.Tensor | None:
        """Device statistics of a verified step, sent to the host with the step's other results."""
        return None

    def observe(self, values: list[float]) -> None:
        """The host copy of ``feedback``'s tensor."""

    def observe_time(self, num_live: int, shape: TreeShape | None, seconds: float, catch_up_tokens: int = 0) -> None:
        """The measured wall time of a step that ran ``shape`` (None: plain) with ``num_live`` sequences,
        whose draft caught up on ``catch_up_tokens`` pairs (padded, all sequences together)."""

    def observe_startup(self, seconds: float) -> None:
        """The measured wall time of the draft's prompt pass (once per rollout that speculates)."""

    def observe_lengths(self, lengths: list[int]) -> None:
        """The completion lengths of a finished rollout."""

    def forget(self, keep: float) -> None:
        """The draft has changed (online learning): weigh the acceptance seen so far by ``keep`` in [0, 1]."""

    def state_dict(self) -> dict:
        """What the policy has learnt (tensors and JSON scalars), for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""


def _bounds_of(shape: TreeShape | None) -> tuple[int, int]:
    if shape is None:
        return 1, 0
    return shape.num_nodes, (shape.depth - 1) * shape.top_k


class OffSizing(SizingPolicy):
    name = "off"

    def bounds(self) -> tuple[int, int]:
        return 1, 0

    def choose(self, num_live: int, *, draft_ready: bool = True, position: int = 0) -> TreeShape | None:
        return None


class FixedSizing(SizingPolicy):
    name = "fixed"

    def __init__(self, shape: TreeShape | tuple[int, int, int] = TreeShape(4, 4, 16)):
        self.shape = TreeShape(*shape).validate()

    def bounds(self) -> tuple[int, int]:
        return _bounds_of(self.shape)

    def choose(self, num_live: int, *, draft_ready: bool = True, position: int = 0) -> TreeShape | None:
        return self.shape


class FastGRPOSizing(SizingPolicy):
    name = "fastgrpo"

    def __init__(self, c_peak: int, *, alpha: float = 0.75, k_max: int = DEFAULT_K_MAX,
                 l_max: int = DEFAULT_L_MAX, n_max: int = DEFAULT_N_MAX):
        if c_peak < 1:
            raise ValueError(f"fastgrpo sizing: c_peak must be >= 1, got {c_peak!r}")
        if not alpha > 0:
            raise ValueError(f"fastgrpo sizing: alpha must be > 0, got {alpha!r}")
        _check_limits(k_max, l_max, n_max)
        self.c_peak, self.alpha, self.k_max, self.l_max, self.n_max = c_peak, alpha, k_max, l_max, n_max

    def bounds(self) -> tuple[int, int]:
        return self.n_max, (self.l_max - 1) * self.k_max

    def choose(self, num_live: int, *, draft_ready: bool = True, position: int = 0) -> TreeShape | None:
        nodes = min(self.c_peak // max(num_live, 1), self.n_max)
        if nodes < 2:  # no verify token to spare: speculation is off, not log2(0)
            return None
        top_k = min(nodes - 1, self.k_max)
        depth = max(1, min(math.floor(math.log2(nodes / self.alpha)), self.l_max, nodes - 1))
        nodes = min(nodes, 1 + top_k + (depth - 1) * top_k * top_k)
        return TreeShape(top_k, depth, nodes)


class CostSizing(SizingPolicy):
    """See the module docstring."""

    name = "cost"
    PRIOR_WEIGHT = 4.0   # pseudo-observations behind the prior, so a few real trees outweigh it
    REFRESH_STEPS = 16   # re-derive the choices after this many new observations (a tree step brings two)
    TIME_WEIGHT = 0.3    # exponential average of measured overheads: follows drift, damps noise
    EXPLORE_EVERY = 32   # while speculation is off, one step in this many still tries the best tree
    LENGTH_HISTORY = 4096  # completion lengths of past rollouts kept to predict how long this one runs

    def __init__(self, profile: LatencyProfile, *, k_max: int = DEFAULT_K_MAX, l_max: int = DEFAULT_L_MAX,
                 n_max: int = DEFAULT_N_MAX, margin: float = 0.1, prior_top1: float = 0.5):
        if profile.draft is None:
            raise ValueError("cost sizing needs a latency profile with a draft curve (profile with draft=...)")
        _check_limits(k_max, l_max, n_max)
        if not 0 < prior_top1 < 1:
            raise ValueError(f"cost sizing: prior_top1 must be in (0, 1), got {prior_top1!r}")
        self.profile, self.k_max, self.l_max, self.n_max, self.margin = profile, k_max, l_max, n_max, margin
        ranks = torch.arange(k_max, dtype=torch.float64)
        self.prior = (prior_top1 * (1 - prior_top1) ** ranks).expand(l_max, k_max)   # [depth, rank]
        self.matches = torch.zeros(l_max, k_max, dtype=torch.float64)
        self.trials = torch.zeros(l_max, k_max, dtype=torch.float64)
        self.menu = [(k, l) for k in (1, 2, 4, 8, 16) if k <= k_max for l in range(1, l_max + 1)]
        # Measured step time / the curves' prediction, for plain and for tree steps: what the curves
        # miss (Python and bookkeeping around the forwards, a busier machine than when profiled).
        self.plain_scale = 1.0
        self.tree_scale = 1.0
        self.num_timed = {"plain": 0, "tree": 0}
        # Live-batch bucket -> plain_scale measured there alone: the realised gain compares a tree step
        # with plain steps at its own B (the overhead the curves miss is a different share at B=1 and
        # B=64, so one scale overstated plain steps at B=64 and made losing trees look like gains there).
        self.plain_scale_by_bucket: dict[int, float] = {}
        self._expected: torch.Tensor | None = None  # [menu, n_max]: E[accepted] with N = 1 + index
        # B -> (best tree, its predicted token rate over plain decoding's)
        self._choices: dict[int, tuple[TreeShape | None, float]] = {}
        self._new_observations = 0
        self._plain_streak = 0
        self.startup_seconds = 0.0   # the draft's prompt pass, as last measured
        self.past_lengths: deque[int] = deque(maxlen=self.LENGTH_HISTORY)
        self._lengths = torch.zeros(0, dtype=torch.float64)  # past_lengths as a tensor, for the quantile
        # Live-batch bucket -> [decayed sums of its tree steps' tokens x plain seconds per token and of
        # their sequences x seconds (the realised gain is their ratio), tree steps seen]
        self.realised: dict[int, list[float]] = {}
        # (B, seconds, catch-up pairs) of the tree step awaiting its counts
        self._timed_tree: tuple[int, float, int] | None = None

    def bounds(self) -> tuple[int, int]:
        return self.n_max, (self.l_max - 1) * self.k_max

    def acceptance(self) -> torch.Tensor:
        """``a[d, r]``: P(the policy's draw is the rank-(r+1) child | a node at depth d has that child).

        Each depth's prior is the estimate one level up (the first level's is ``prior_top1``'s
        geometric ranks): deep nodes are tried only by deep trees, so a fixed prior there would keep
        deep trees looking as poor as the prior, and the policy would never try one to learn better.
        """
        estimates = torch.empty_like(self.prior)
        prior = self.prior[0]
        for depth in range(self.l_max):
            prior = (self.matches[depth] + self.PRIOR_WEIGHT * prior) / (self.trials[depth] + self.PRIOR_WEIGHT)
            estimates[depth] = prior
        return estimates

    def refresh(self) -> None:
        """Re-derive the expected-acceptance table and forget the choices made from the old one."""
        self._expected = expected_accepted_table(self.acceptance(), self.menu, self.n_max)
        self._choices.clear()
        self._new_observations = 0

    def _choice(self, num_live: int) -> tuple[TreeShape | None, float]:
        """The best tree at ``num_live`` and its predicted gain, from the current tables (cached)."""
        if self._expected is None or self._new_observations >= self.REFRESH_STEPS:
            self.refresh()
        if num_live not in self._choices:
            self._choices[num_live] = self._best_shape(num_live)
        return self._choices[num_live]

    def choose(self, num_live: int, *, draft_ready: bool = True, position: int = 0) -> TreeShape | None:
        if self.num_timed["plain"] == 0:
            return None  # one measured plain step anchors the comparison before any tree is tried
        tree, gain = self._choice(num_live)
        if (gain > 1 + self.margin and not self.loses(num_live)
                and (draft_ready or self._repays_startup(num_live, position, gain))):
            self._plain_streak = 0
            return tree
        self._plain_streak += 1
        # Exploring only once the draft has read the prompts: a lone exploratory tree would
        # otherwise pay for the whole prompt pass.
        if tree is not None and draft_ready and self._plain_streak >= self.EXPLORE_EVERY:
            self._plain_streak = 0
            return tree
        return None

    def predicted_gain(self, num_live: int) -> float:
        return self._choice(num_live)[1]

    MIN_REALISED = 4  # tree steps of a bucket before its realised gain can veto trees
    REALISED_DECAY = 0.9  # weight of earlier tree steps in the realised gain, per tree step of the bucket

    @staticmethod
    def bucket(num_live: int) -> int:
        """The live-batch bucket of ``num_live``: the power of two at or below it."""
        return 1 << (max(num_live, 1).bit_length() - 1)

    def loses(self, num_live: int) -> bool:
        """Whether measured tree steps at about this live batch emitted fewer tokens per second than
        plain steps do (realised gain below 1 over at least ``MIN_REALISED`` of them)."""
        entry = self.realised.get(self.bucket(num_live))
        return entry is not None and entry[2] >= self.MIN_REALISED and entry[0] < entry[1]

    def _repays_startup(self, num_live: int, position: int, gain: float) -> bool:
        """Whether speculating from here on saves more time than the draft's prompt pass costs: the
        time saved per plain step, times the plain steps the rollout is expected to have left."""
        if self.startup_seconds == 0 or not self.past_lengths:
            return True  # nothing measured yet
        saved_per_step = self._plain_time(num_live) * (1 - 1 / gain)
        return saved_per_step * self.expected_remaining(num_live, position) >= self.startup_seconds

    def expected_remaining(self, num_live: int, position: int) -> float:
        """Plain steps left until the last of ``num_live`` sequences that have each generated
        ``position`` tokens finishes, from the lengths of past rollouts: the ``B / (B + 1)``
        quantile of the remaining lengths (about the expected maximum of B draws)."""
        remaining = self._lengths[self._lengths > position] - position
        if remaining.numel() == 0:
            return 0.0
        return float(torch.quantile(remaining, num_live / (num_live + 1)))

    def observe_startup(self, seconds: float) -> None:
        self.startup_seconds = seconds

    def observe_lengths(self, lengths: list[int]) -> None:
        self.past_lengths.extend(lengths)
        self._lengths = torch.tensor(self.past_lengths, dtype=torch.float64)

    def _best_shape(self, num_live: int) -> tuple[TreeShape | None, float]:
        """The tree with the best predicted token rate, and that rate over plain decoding's."""
        expected = self._expected                                       # [menu, n_max]
        nodes = torch.arange(1, self.n_max + 1, dtype=torch.float64)    # N = 1 .. n_max
        top_k = torch.tensor([k for k, _ in self.menu], dtype=torch.float64)[:, None]
        depth = torch.tensor([l for _, l in self.menu], dtype=torch.float64)[:, None]
        rate = num_live * (1 + expected) / self._tree_time(num_live, top_k, depth, nodes, expected)
        rate = torch.where(nodes <= 1 + top_k + (depth - 1) * top_k * top_k, rate, 0.0)
        # Beyond the profiled range the curve is an extrapolation; no tree is chosen on a guess.
        rate = torch.where(num_live * nodes <= self.profile.verify.num_tokens[-1], rate, 0.0)
        rate[:, 0] = 0.0  # N = 1 is no tree: that is the plain step below
        best = int(rate.argmax())
        if rate.flatten()[best] <= 0:
            return None, 0.0
        row, column = divmod(best, self.n_max)
        k, l = self.menu[row]
        plain_rate = num_live / self._plain_time(num_live)
        return TreeShape(k, l, column + 1), float(rate.flatten()[best]) / plain_rate

    def _plain_time(self, num_live: int) -> float:
        return max(self.profile.verify(num_live) * self.plain_scale, 1e-9)

    def _tree_time(self, num_live: int, top_k, depth, nodes, expected, catch_up_tokens=None) -> torch.Tensor:
        """Seconds of a tree step: the draft's catch-up pass (about E[accepted] + 1 pairs per sequence
        unless given), its L - 1 level forwards and the policy's forward over B * N tokens, scaled by
        what measured tree steps took."""
        draft, verify = self.profile.draft, self.profile.verify
        if catch_up_tokens is None:
            catch_up_tokens = num_live * (expected + 1)
        seconds = (draft.at(torch.as_tensor(catch_up_tokens, dtype=torch.float64))
                   + (depth - 1) * draft.at(num_live * top_k) + verify.at(num_live * nodes))
        return (seconds * self._current_tree_scale()).clamp(min=1e-9)

    def _current_tree_scale(self) -> float:
        # Until a tree step is timed, trees are assumed to miss the curves as plain steps do (an
        # untimed neutral 1.0 against a measured plain scale would price trees by a different clock).
        return self.tree_scale if self.num_timed["tree"] else self.plain_scale

    def observe_time(self, num_live: int, shape: TreeShape | None, seconds: float, catch_up_tokens: int = 0) -> None:
        kind = "plain" if shape is None else "tree"
        self._timed_tree = None if shape is None else (num_live, seconds, catch_up_tokens)
        if shape is None:
            ratio = seconds / max(self.profile.verify(num_live), 1e-9)
        else:
            k, l, n = (torch.tensor([[float(v)]], dtype=torch.float64) for v in shape)
            predicted = float(self._tree_time(num_live, k, l, n, 0.0, catch_up_tokens))
            ratio = seconds * self._current_tree_scale() / predicted
        # The first measurement replaces the neutral start; later ones move an exponential average.
        weight = 1.0 if self.num_timed[kind] == 0 else self.TIME_WEIGHT
        scale = self.plain_scale if shape is None else self.tree_scale
        scale += weight * (ratio - scale)
        if shape is None:
            self.plain_scale = scale
            bucket = self.bucket(num_live)
            previous = self.plain_scale_by_bucket.get(bucket)
            self.plain_scale_by_bucket[bucket] = ratio if previous is None else previous + self.TIME_WEIGHT * (
                ratio - previous)
        else:
            self.tree_scale = scale
        self.num_timed[kind] += 1
        self._new_observations += 1

    def describe(self) -> dict:
        """What the policy has learnt (for logs and benchmarks)."""
        return {"plain_scale": self.plain_scale, "tree_scale": self.tree_scale, "num_timed": dict(self.num_timed),
                "plain_scale_by_bucket": dict(sorted(self.plain_scale_by_bucket.items())),
                "top1_acceptance_by_depth": self.acceptance()[:, 0].tolist(),
                "realised_gain_by_bucket": {b: {"gain": saved / max(spent, 1e-12), "tree_steps": int(n)}
                                            for b, (saved, spent, n) in sorted(self.realised.items())}}

    def feedback(self, tree: DraftTree, verdict: TreeVerdict) -> torch.Tensor:
        return acceptance_counts(tree, verdict, self.l_max, self.k_max)

    def forget(self, keep: float) -> None:
        self.matches *= keep
        self.trials *= keep
        self._expected = None  # re-derive the choices from the discounted counts

    def state_dict(self) -> dict:
        return {"matches": self.matches.clone(), "trials": self.trials.clone(), "plain_scale": self.plain_scale,
                "tree_scale": self.tree_scale, "num_timed": dict(self.num_timed),
                "startup_seconds": self.startup_seconds, "past_lengths": list(self.past_lengths),
                "plain_streak": self._plain_streak, "realised": {str(b): v for b, v in self.realised.items()},
                "plain_scale_by_bucket": {str(b): v for b, v in self.plain_scale_by_bucket.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.matches, self.trials = state["matches"].to(torch.float64), state["trials"].to(torch.float64)
        self.plain_scale, self.tree_scale = state["plain_scale"], state["tree_scale"]
        self.num_timed, self.startup_seconds = dict(state["num_timed"]), state["startup_seconds"]
        self.past_lengths.clear()
        self.observe_lengths(list(state["past_lengths"]))
        self._plain_streak = state["plain_streak"]
        # Checkpoints from before the realised-gain guard have none: it starts empty. Those from before
        # the ratio of sums hold [gain, count]: a gain over one unit of time.
        self.realised = {int(b): list(v) if len(v) == 3 else [v[0], 1.0, v[1]]
                         for b, v in state.get("realised", {}).items()}
        self.plain_scale_by_bucket = {int(b): v for b, v in state.get("plain_scale_by_bucket", {}).items()}
        self._expected = None

    def observe(self, values: list[float]) -> None:
        counts = torch.tensor(values, dtype=torch.float64).view(2, self.l_max, self.k_max)
        self.matches += counts[0]
        self.trials += counts[1]
        self._new_observations += 1
        if self._timed_tree is not None:
            num_live, seconds, catch_up_tokens = self._timed_tree
            self._timed_tree = None
            # Tokens per second of this step (every sequence's root plus the accepted draft tokens:
            # each match is one) over plain decoding's at this B, as the step would run among tree
            # steps: without the catch-up on a backlog that plain steps before it left.
            emitted = num_live + float(counts[0].sum())
            # The backlog's share comes from a curve, a model: it never takes more than half the step.
            seconds = max(seconds - self._backlog_seconds(catch_up_tokens, emitted), 0.5 * seconds)
            plain_seconds = self.profile.verify(num_live) * self.plain_scale_by_bucket.get(
                self.bucket(num_live), self.plain_scale)
            self._record_gain(num_live, emitted * plain_seconds, num_live * max(seconds, 1e-9))

    def _backlog_seconds(self, catch_up_tokens: int, steady_tokens: float) -> float:
        """The part of a catch-up pass over ``catch_up_tokens`` pairs beyond the ``steady_tokens`` a run of
        tree steps leaves (the tokens the last step emitted): the cost of switching trees on after plain
        steps (an exploratory tree pays the whole streak's backlog), not of a tree step. From the draft
        curve, at the tree steps' measured scale."""
        if catch_up_tokens <= steady_tokens:
            return 0.0
        draft = self.profile.draft
        return self._current_tree_scale() * max(draft(catch_up_tokens) - draft(steady_tokens), 0.0)

    def _record_gain(self, num_live: int, plain_seconds: float, seconds: float) -> None:
        """Add a tree step to its bucket's realised gain: ``plain_seconds``, what plain steps would have
        taken for the tokens it emitted (times B), against the ``seconds`` it took (times B). A ratio
        of decayed sums, not an average of per-step ratios: at B=1 a step emits 1 or 2 tokens, so
        single ratios swing by 2x, and an average that followed the last few swung below 1 (a veto)
        often enough to keep paying trees off (SmolLM2 greedy at B=1: 0.96 realised from trees that
        ran 1.23x)."""
        entry = self.realised.setdefault(self.bucket(num_live), [0.0, 0.0, 0])
        entry[0] = self.REALISED_DECAY * entry[0] + plain_seconds
        entry[1] = self.REALISED_DECAY * entry[1] + seconds
        entry[2] += 1


class MergedSizing(SizingPolicy):
    """Sizing for a neural draft merged with history drafts: two policies, one per kind of tree.

    ``neural`` sizes the neural draft's trees (with the history's chains merged in); ``history`` sizes
    trees of history chains alone, which run no draft forward. Each step takes the tree of the policy
    predicting the larger gain over plain decoding (``predicted_gain``; a policy without predictions
    counts as 1), and plays plain where neither speculates. What a tree step teaches (its time and
    acceptance counts) goes to the policy that chose it; plain steps' times and completion lengths go
    to both; the draft's changes (``forget``, ``observe_startup``) concern ``neural`` only. So at
    greedy decoding of a recurring prompt the history's long chains run where the neural draft's
    trees do not pay, and the other way round.
    """

    name = "merged"
    MIN_TRIES = 2
    """Tree steps each kind runs first in a rollout, where both would speculate, before predictions
    decide: a policy learns its acceptance only from its own trees (merged trees teach the neural
    policy what the chains in them accepted too, so without a few tries of its own the history's
    policy would stay at its prior and lose to them)."""
    EXPLORE_EVERY = 16
    """Where both would speculate, one tree step in this many runs the kind predictions do not
    favour, so that its statistics follow the text (the history's chains find nothing in the first
    rollout of a prompt, and much once its store holds that rollout)."""

    def __init__(self, neural: SizingPolicy, history: SizingPolicy):
        self.neural, self.history = neural, history
        self.history_alone = False
        """Whether the last tree chosen is the history's chains alone (host state, per step)."""
        self.tries = {"neural": 0, "history": 0}
        self._favoured_streak = 0

    @property
    def _chosen(self) -> SizingPolicy:
        return self.history if self.history_alone else self.neural

    def bounds(self) -> tuple[int, int]:
        (neural_nodes, slots), (history_nodes, _) = self.neural.bounds(), self.history.bounds()
        return max(neural_nodes, history_nodes), slots  # history chains write no draft slot

    def choose(self, num_live: int, *, draft_ready: bool = True, position: int = 0) -> TreeShape | None:
        neural = self.neural.choose(num_live, draft_ready=draft_ready, position=position)
        history = self.history.choose(num_live, position=position)
        if history is None or neural is None:
            self.history_alone = history is not None
        elif min(self.tries.values()) < self.MIN_TRIES:
            self.history_alone = self.tries["history"] <= self.tries["neural"]
        else:
            favoured = self.history.predicted_gain(num_live) > self.neural.predicted_gain(num_live)
            self._favoured_streak += 1
            explore = self._favoured_streak >= self.EXPLORE_EVERY
            self._favoured_streak = 0 if explore else self._favoured_streak
            self.history_alone = favoured != explore
        chosen = history if self.history_alone else neural
        if chosen is not None:
            self.tries["history" if self.history_alone else "neural"] += 1
        return chosen

    def feedback(self, tree: DraftTree, verdict: TreeVerdict) -> torch.Tensor | None:
        return self._chosen.feedback(tree, verdict)

    def observe(self, values: list[float]) -> None:
        self._chosen.observe(values)

    def observe_time(self, num_live: int, shape: TreeShape | None, seconds: float, catch_up_tokens: int = 0) -> None:
        for policy in ((self.neural, self.history) if shape is None else (self._chosen,)):
            policy.observe_time(num_live, shape, seconds, catch_up_tokens)

    def observe_startup(self, seconds: float) -> None:
        self.neural.observe_startup(seconds)

    HISTORY_KEEP = 0.5
    """Weight of the history's acceptance counts after each rollout: its candidates change with its
    store (a prompt's first rollout finds little, the next one its whole text)."""

    def observe_lengths(self, lengths: list[int]) -> None:
        """A rollout ended: the history's store has changed, so its counts are discounted and each
        kind is tried again first in the next rollout."""
        self.neural.observe_lengths(lengths)
        self.history.observe_lengths(lengths)
        self.history.forget(self.HISTORY_KEEP)
        self.tries = dict.fromkeys(self.tries, 0)

    def forget(self, keep: float) -> None:
        self.neural.forget(keep)  # the history's chains do not depend on the draft

    def describe(self) -> dict:
        return {kind: policy.describe() if hasattr(policy, "describe") else None
                for kind, policy in (("neural", self.neural), ("history", self.history))}

    def state_dict(self) -> dict:
        return {f"{kind}.{key}": value for kind, policy in (("neural", self.neural), ("history", self.history))
                for key, value in policy.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        if not any(key.startswith(("neural.", "history.")) for key in state):
            self.neural.load_state_dict(state)  # a checkpoint from before merged sizing: the neural policy's
            return
        for kind, policy in (("neural", self.neural), ("history", self.history)):
            prefix = f"{kind}."
            policy.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})


def expected_accepted_table(acceptance: torch.Tensor, menu: list[tuple[int, int]], n_max: int) -> torch.Tensor:
    """``[len(menu), n_max]``: expected accepted tokens of the tree ``build_tree`` would build for each
    (K, L) in ``menu`` and ``N = 1 + column`` nodes, if child r at depth d were accepted with
    probability ``acceptance[d-1, r-1]`` independently (host work, a few milliseconds)."""
    table = torch.zeros(len(menu), n_max, dtype=torch.float64)
    for row, (k, l) in enumerate(menu):
        frontier = acceptance[0, :k].clone()
        pool = [frontier]
        for depth in range(1, l):
            children = (frontier[:, None] * acceptance[depth, :k]).flatten()
            pool.append(children)
            frontier = children.topk(k).values
        best = torch.cat(pool).sort(descending=True).values[: n_max - 1]
        sums = torch.cat([torch.zeros(1, dtype=torch.float64), best.cumsum(0)])
        table[row, :len(sums)] = sums
        table[row, len(sums):] = sums[-1]
    return table


def acceptance_counts(tree: DraftTree, verdict: TreeVerdict, max_depth: int, max_rank: int) -> torch.Tensor:
    """``[2 * max_depth * max_rank]``: (matches, trials) per (child depth, sibling rank), summed over
    every node on the walked paths. A walked node with c children is a trial for ranks 1..c at its
    children's depth; the child it moved to (if any) is a match at that child's rank."""
    last = verdict.path_nodes.gather(1, verdict.num_accepted[:, None])                     # [B, 1]
    walked = tree.ancestors.gather(1, last[:, :, None].expand(-1, 1, tree.tokens.shape[1])).squeeze(1)
    is_child = torch.ones_like(tree.path_logprobs)
    is_child[:, 0] = 0.0  # the root is its own parent but not its own child
    num_children = torch.zeros_like(is_child).scatter_add_(1, tree.parents, is_child)     # [B, N]
    siblings = tree.parents[:, :, None] == tree.parents[:, None, :]
    siblings[:, :, 0] = False  # the root shares its "parent" (itself) with depth-1 nodes, not a rank
    rank = (siblings & (tree.path_logprobs[:, None, :] > tree.path_logprobs[:, :, None])).sum(-1)

    ranks = torch.arange(max_rank, device=rank.device)
    tried = (walked & (tree.depths < max_depth))[:, :, None] & (num_children[:, :, None] > ranks)  # [B, N, R]
    trials = torch.zeros(max_depth, max_rank, device=rank.device).index_put_(
        (tree.depths.clamp(max=max_depth - 1).flatten(),), tried.flatten(0, 1).float(), accumulate=True)
    matched = walked & (tree.depths > 0)
    matches = torch.zeros(max_depth * max_rank, device=rank.device).index_put_(
        (((tree.depths - 1).clamp(0, max_depth - 1) * max_rank + rank.clamp(max=max_rank - 1)).flatten(),),
        matched.flatten().float(), accumulate=True)
    return torch.cat([matches, trials.flatten()])


def _check_limits(k_max: int, l_max: int, n_max: int) -> None:
    for name, value in (("k_max", k_max), ("l_max", l_max), ("n_max", n_max)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"sizing {name} must be an integer >= 1, got {value!r}")
    if n_max < 2:
        raise ValueError(f"sizing n_max must be >= 2 (the root and one draft node), got {n_max!r}")


SIZING_POLICIES: dict[str, type[SizingPolicy]] = {
    cls.name: cls for cls in (OffSizing, FixedSizing, FastGRPOSizing, CostSizing)}


def make_sizing(name: str, *, profile: LatencyProfile | None = None, **options) -> SizingPolicy:
    """Build the registered policy ``name``; ``profile`` feeds ``fastgrpo`` (its knee, unless
    ``c_peak=`` is given) and ``cost`` (its curves)."""
    if name not in SIZING_POLICIES:
        raise ValueError(f"sizing policy must be one of {sorted(SIZING_POLICIES)}, got {name!r}")
    if name == "fastgrpo" and "c_peak" not in options:
        if profile is None:
            raise ValueError("fastgrpo sizing needs c_peak=... or a latency profile")
        options["c_peak"] = profile.c_peak
    if name == "cost":
        if profile is None:
            raise ValueError("cost sizing needs a latency profile")
        options["profile"] = profile
    return SIZING_POLICIES[name](**options)
