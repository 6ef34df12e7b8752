"""What bench/tree.py and bench/tree_real.py share: a batch in every layout (``Case``), the contenders that score
it, and the real model (SmolLM2-135M-Instruct) that both load. Its own module, so that neither benchmark imports
the other."""

from __future__ import annotations

import sys
from functools import cache, cached_property
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix import BENCH_MODEL, run_prefix_grouper  # noqa: E402

import turbogrpo  # noqa: E402
from turbogrpo.tree import TokenTrie, build_trie, per_sequence_logprobs, tree_logprobs  # noqa: E402

REAL_MODEL = "smollm2-135m-instruct"


def parse_shape(shape: str) -> tuple[int, list[int], int]:
    prompt, branching, turn = shape.split("/")
    return int(prompt), [int(b) for b in branching.split("x")], int(turn)


class Case:
    """One batch's inputs in every layout: K prompts with their groups' completions (prompt-only sharing), and
    the trie of the whole sequences, scored where ``loss_masks`` (per group, per completion ``[S]`` bool: the
    model's tokens of a conversation) is set; None scores every completion token."""

    def __init__(self, prompts: list[torch.Tensor], completions: list[list[torch.Tensor]],
                 loss_masks: list[list[torch.Tensor]] | None = None):
        self.prompts, self.completions = prompts, completions
        self.loss_masks = loss_masks or [[torch.ones(len(c), dtype=torch.bool) for c in group] for group in completions]
        paths, masks = [], []
        for prompt, group, group_masks in zip(prompts, completions, self.loss_masks):
            for completion, mask in zip(group, group_masks):
                paths.append(torch.cat([prompt, completion]))
                masks.append(torch.cat([torch.zeros(len(prompt), dtype=torch.bool), mask]))
        self.trie = build_trie(paths, masks)

    @staticmethod
    def synthetic(shape: str, seed: int = 0, vocab: int = BENCH_MODEL["vocab_size"]) -> Case:
        """The deep trie of ``shape`` (module docstring), random ids below ``vocab``; every token after the
        prompt is scored."""
        prompt_len, branching, turn = parse_shape(shape)
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        paths = [prompt]
        for fanout in branching:
            paths = [torch.cat([p, torch.randint(0, vocab, (turn,), generator=g)])
                     for p in paths for _ in range(fanout)]
        return Case([prompt], [[p[prompt_len:] for p in paths]])

    @cached_property
    def per_turn(self) -> TokenTrie:
        """One sequence per scored run of tokens (a conversation's model turn): the prompt and everything
        before the turn, then the turn, scored alone (step-wise samples, each with its whole history)."""
        paths, masks = [], []
        for prompt, group, group_masks in zip(self.prompts, self.completions, self.loss_masks):
            for completion, mask in zip(group, group_masks):
                flags = mask.tolist()
                starts = [t for t, f in enumerate(flags) if f and (t == 0 or not flags[t - 1])]
                ends = [t + 1 for t, f in enumerate(flags) if f and (t + 1 == len(flags) or not flags[t + 1])]
                for start, end in zip(starts, ends):
                    scored = torch.zeros(len(prompt) + end, dtype=torch.bool)
                    scored[len(prompt) + start:] = True
                    paths.append(torch.cat([prompt, completion[:end]]))
                    masks.append(scored)
        return build_trie(paths, masks)

    def save(self, path: Path) -> None:
        torch.save({"prompts": self.prompts, "completions": self.completions, "loss_masks": self.loss_masks}, path)

    @staticmethod
    def load(path: Path) -> Case:
        return Case(**torch.load(path))


def run_rows(model, case: Case) -> None:
    per_sequence_logprobs(model, case.trie).logps.mean().backward()


def run_prefix_grouper_case(model, case: Case) -> None:
    run_prefix_grouper(model, case.prompts, case.completions)


def run_one_level(model, case: Case) -> None:
    per_group = turbogrpo.completion_logprobs(model, case.prompts, case.completions, backend="cascade")
    torch.cat([t for group in per_group for t in group]).mean().backward()


def run_tree(model, case: Case, backend: str = "cascade") -> None:
    tree_logprobs(model, case.trie, backend=backend).logps.mean().backward()


CONTENDERS = {"rows": run_rows, "prefix_grouper": run_prefix_grouper_case, "one_level": run_one_level,
              "tree": run_tree}


@cache
def real_model():
    """SmolLM2-135M-Instruct in float32, and its tokenizer (loaded once per process)."""
    from turbogrpo.models import load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(REAL_MODEL)
    return model.float().eval(), tokenizer


def run_per_turn(model, case: Case) -> None:
    per_sequence_logprobs(model, case.per_turn).logps.mean().backward()


REAL_CONTENDERS = {**CONTENDERS, "per_turn": run_per_turn}
