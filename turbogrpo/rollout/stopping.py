"""When a completion stops: stop token ids and stop strings, checked on the device for all rows at once.

A stop string is matched against the completion's text, read as the concatenation of its tokens'
individual decodings (``tokenizer.decode([id])``). A completion stops after the first token in which
an occurrence of a stop string ends; that token is kept. Matching happens in token space, with
tables built once per (tokenizer, stop strings): for the newest token ``u0`` and earlier tokens
``u1, u2, ...`` an occurrence of ``s`` (length m) ends in ``u0`` when

* ``s`` lies inside ``u0`` (``contains``), or
* ``u0`` starts with the last ``m - r`` characters of ``s`` (``head[u0, r]``, r characters left to
  find), the tokens before it spell ``s[:r]`` backwards piece by piece (``middle``: a token equal to
  the ``len(u)`` characters before the r-th, leaving ``r - len(u)``), and the piece reached last
  ends with what is left (``tail[u, r]``: ``u`` ends with ``s[:r]``).

Tokens decoding to partial characters (a multi-byte character split across byte-level tokens)
decode to replacement characters and so cannot take part in a match, and tokens that decode to no
text still take a window slot, so an occurrence interrupted by many of them can be missed; stop
strings made of whole characters per token, the usual case, are matched exactly.

Shapes: ``R`` rows being checked, ``W`` window (longest stop string, in characters), ``S`` number of
stop strings, ``M`` = W, ``V`` table rows (tokenizer vocabulary + one "no token" row).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from turbogrpo.rollout.sampling import SamplingConfig

NO_TOKEN = -1
"""Window entry before the completion's first token."""


class StopStringMatcher:
    """Finds stop-string occurrences that end in the newest token of each row's window."""

    def __init__(self, token_strings: Sequence[str], stop_strings: Sequence[str]):
        """``token_strings[i]`` is the decoding of token ``i``; tables are built on the CPU."""
        self.window = max(len(s) for s in stop_strings)
        num_rows, num_strings, width = len(token_strings) + 1, len(stop_strings), self.window
        hits: dict[str, list[tuple[int, ...]]] = {"contains": [], "head": [], "tail": [], "middle": []}
        for token, text in enumerate(token_strings):
            for index, stop in enumerate(stop_strings):
                _collect_hits(hits, token, index, text, stop)
        self.contains_VS = _bool_table((num_rows, num_strings), hits["contains"])
        self.head_VSM = _bool_table((num_rows, num_strings, width), hits["head"])
        self.tail_VSM = _bool_table((num_rows, num_strings, width), hits["tail"])
        self.middle_VSM = _bool_table((num_rows, num_strings, width), hits["middle"])
        self.length_V = torch.tensor([len(text) for text in token_strings] + [0], dtype=torch.long)

    def to(self, device: torch.device | str) -> StopStringMatcher:
        moved = object.__new__(StopStringMatcher)
        moved.window = self.window
        for name in ("contains_VS", "head_VSM", "tail_VSM", "middle_VSM", "length_V"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def __call__(self, window_RW: torch.Tensor) -> torch.Tensor:
        """``window_RW [R, W]``: each row's last W tokens, oldest first, ``NO_TOKEN`` before the first.
        Returns ``[R]`` bool: an occurrence of a stop string ends in the row's last token.
        """
        no_token_row = self.length_V.shape[0] - 1
        tokens_RW = torch.where((window_RW < 0) | (window_RW >= no_token_row), no_token_row, window_RW)
        newest = tokens_RW[:, -1]
        found_R = self.contains_VS[newest].any(dim=-1)
        left_RSM = self.head_VSM[newest]  # [R, S, M]: r characters of the stop string still to find
        width = self.window
        offsets_M = torch.arange(width, device=window_RW.device)
        for back in range(2, width + 1):  # a loop over window positions, not over rows
            token = tokens_RW[:, -back]
            found_R |= (left_RSM & self.tail_VSM[token]).any(dim=(1, 2))
            moved_RSM = left_RSM & self.middle_VSM[token]
            # r characters left before this token -> r - len(token) after it.
            source_RM = offsets_M + self.length_V[token].unsqueeze(-1)
            in_range_RM = source_RM < width
            source_RSM = source_RM.clamp(max=width - 1).unsqueeze(1).expand_as(moved_RSM)
            left_RSM = moved_RSM.gather(-1, source_RSM) & in_range_RM.unsqueeze(1)
        return found_R


def _collect_hits(hits: dict[str, list[tuple[int, ...]]], token: int, index: int, text: str,
                  stop: str) -> None:
    if stop in text:
        hits["contains"].append((token, index))
    if text and not (text[0] in stop or text[-1] in stop):
        return  # cannot start, end or continue a partial occurrence: skips most of the vocabulary
    for left in range(1, len(stop)):
        if text.startswith(stop[left:]):
            hits["head"].append((token, index, left))
        if text.endswith(stop[:left]):
            hits["tail"].append((token, index, left))
        if len(text) < left and stop[left - len(text):left] == text:
            hits["middle"].append((token, index, left))


def _bool_table(shape: tuple[int, ...], true_at: list[tuple[int, ...]]) -> torch.Tensor:
    table = torch.zeros(shape, dtype=torch.bool)
    if true_at:
        table[tuple(torch.tensor(true_at, dtype=torch.long).unbind(-1))] = True
    return table


_MATCHER_CACHE: OrderedDict[tuple[int, tuple[str, ...]], tuple[object, StopStringMatcher]] = OrderedDict()
_MATCHER_CACHE_SIZE = 8


def stop_string_matcher(tokenizer, stop_strings: tuple[str, ...]) -> StopStringMatcher:
    """The (CPU) matcher for ``tokenizer`` and ``stop_strings``, built once and cached: building it
    decodes the whole vocabulary, which a rollout per training step should not repeat."""
    key = (id(tokenizer), stop_strings)
    cached = _MATCHER_CACHE.get(key)
    if cached is not None and cached[0] is tokenizer:
        _MATCHER_CACHE.move_to_end(key)
        return cached[1]
    token_strings = tokenizer.batch_decode([[i] for i in range(len(tokenizer))],
                                           skip_special_tokens=False, clean_up_tokenization_spaces=False)
    matcher = StopStringMatcher(token_strings, stop_strings)
    # The tokenizer is held with its matcher so that its id cannot be reused by another object.
    _MATCHER_CACHE[key] = (tokenizer, matcher)
    if len(_MATCHER_CACHE) > _MATCHER_CACHE_SIZE:
        _MATCHER_CACHE.popitem(last=False)
    return matcher


class StopCriteria:
    """Stop tokens and stop strings of one rollout, as device tables."""

    def __init__(self, sampling: SamplingConfig, device: torch.device):
        self.stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
        self.matcher = (stop_string_matcher(sampling.tokenizer, sampling.stop_strings).to(device)
                        if sampling.stop_strings else None)

    @property
    def window(self) -> int:
        """How many trailing tokens ``__call__`` needs per row (0: only the newest token)."""
        return self.matcher.window if self.matcher is not None else 0

    def __call__(self, tokens_R: torch.Tensor, window_RW: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens_R [R]`` newest tokens, ``window_RW [R, W]`` the trailing tokens ending with them
        (needed only when ``window > 0``). Returns ``[R]`` bool: the row stops at this token."""
        stop_R = torch.isin(tokens_R, self.stop_ids)
        if self.matcher is not None:
            stop_R |= self.matcher(window_RW)
        return stop_R
