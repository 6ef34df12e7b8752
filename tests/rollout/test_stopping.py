"""Stop-string matching in token space against a brute-force search over the decoded text."""

import torch

from turbogrpo.rollout.stopping import NO_TOKEN, StopCriteria, StopStringMatcher
from turbogrpo.rollout.sampling import SamplingConfig

# Pieces of 1-3 characters over a small alphabet, so that stop strings often span several tokens.
TOKEN_STRINGS = ["a", "b", "c", "ab", "ba", "ca", "abc", "cab", "bb", "ac", "bca", "cc", "x", "xa", "bx"]
STOP_STRINGS = ["abc", "cab", "bb", "xab", "c"]


def occurrence_ends_in_last_token(tokens: list[int], stops: list[str]) -> bool:
    pieces = [TOKEN_STRINGS[t] for t in tokens]
    text = "".join(pieces)
    last_start = len(text) - len(pieces[-1])
    return any(text.startswith(stop, start) and start + len(stop) > last_start
               for stop in stops for start in range(len(text)))


def windows_of(sequence: list[int], width: int) -> torch.Tensor:
    rows = []
    for end in range(1, len(sequence) + 1):
        window = sequence[max(0, end - width):end]
        rows.append([NO_TOKEN] * (width - len(window)) + window)
    return torch.tensor(rows)


def test_matches_brute_force_on_random_sequences():
    generator = torch.Generator().manual_seed(0)
    for stops in (STOP_STRINGS, ["abc"], ["bcab", "xx"]):
        matcher = StopStringMatcher(TOKEN_STRINGS, stops)
        for _ in range(40):
            sequence = torch.randint(0, len(TOKEN_STRINGS), (12,), generator=generator).tolist()
            found = matcher(windows_of(sequence, matcher.window)).tolist()
            expected = [occurrence_ends_in_last_token(sequence[:end], stops) for end in range(1, 13)]
            assert found == expected, (stops, [TOKEN_STRINGS[t] for t in sequence])


def test_hand_picked_cases():
    matcher = StopStringMatcher(TOKEN_STRINGS, ["abc"])
    index = {s: i for i, s in enumerate(TOKEN_STRINGS)}

    def found(*pieces):
        return bool(matcher(windows_of([index[p] for p in pieces], matcher.window)[-1:]))

    assert found("abc")                 # inside one token
    assert found("x", "ab", "ca")       # ends inside the last token, which runs past it
    assert found("a", "b", "c")         # three single-character tokens
    assert not found("abc", "x")        # the occurrence ended in an earlier token
    assert not found("a", "x", "c")     # broken by a token in between
    assert not found("b", "c")          # needs the "a" that the window does not have


def test_token_ids_outside_the_tokenizer_vocabulary_never_match():
    matcher = StopStringMatcher(TOKEN_STRINGS, ["abc"])
    unknown = len(TOKEN_STRINGS) + 3  # a model vocabulary may be larger than the tokenizer's
    assert matcher(torch.tensor([[unknown, 3, 2]])).item()  # "ab" + "c"
    assert not matcher(torch.tensor([[0, 1, unknown]])).item()


class _PieceTokenizer:
    def __len__(self):
        return len(TOKEN_STRINGS)

    def batch_decode(self, ids, **_):
        return [TOKEN_STRINGS[i[0]] for i in ids]


def test_criteria_combine_stop_tokens_and_stop_strings():
    config = SamplingConfig(max_new_tokens=4, stop_token_ids=[12], stop_strings=["bb"], tokenizer=_PieceTokenizer())
    criteria = StopCriteria(config, torch.device("cpu"))
    windows = torch.tensor([[NO_TOKEN, 12], [1, 1], [0, 2]])
    assert criteria(windows[:, -1], windows).tolist() == [True, True, False]
