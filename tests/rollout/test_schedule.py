"""The decode loop's schedule: a host check every k steps, retirement by buckets, no host sync in a step.

The reference is the schedule that checks after every step and retires finished rows at once (the
engine before host checks were batched): every other schedule must give the same completions, the
same sampler log-probs and the same per-step live counts, for stops inside a window, per-completion
limits, a single live sequence and all sequences finishing in one step.
"""

import pytest
import torch

from tests.rollout.conftest import build_model, forbid_host_syncs_inside, random_prompts
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.decode import BUCKETS, COMPILED_BUCKETS, DecodeSchedule, _rows_to_keep, run_schedule
from turbogrpo.rollout.step import DecodeState, PlainStep

REFERENCE = DecodeSchedule(host_check_every=1, buckets="exact")
SCHEDULES = [DecodeSchedule(3, "exact"), DecodeSchedule(1, "pow2"), DecodeSchedule(4, "pow2"),
             DecodeSchedule(32, "pow2"), DecodeSchedule(1, "step8")]
STOPS = tuple(range(8))  # an eighth of the 64-token vocabulary: lengths vary a lot
CASES = {
    # name: (prompt lengths, samples per prompt, sampling, per-completion limits)
    "stops inside the window": ([5, 9, 3], 4, SamplingConfig(max_new_tokens=16, stop_token_ids=STOPS), None),
    "greedy with stops": ([5, 9, 3], 4, SamplingConfig(max_new_tokens=16, temperature=0.0, stop_token_ids=(1, 2, 3)),
                          None),
    "per-completion limits": ([5, 9], 3, SamplingConfig(max_new_tokens=12, top_k=5, stop_token_ids=(0, 1)),
                              [1, 12, 5, 7, 2, 9]),
    "a single live sequence": ([6], 1, SamplingConfig(max_new_tokens=10, stop_token_ids=STOPS), None),
    "all finishing in one step": ([4, 7], 3, SamplingConfig(max_new_tokens=16), [3] * 6),
}


def run(model, case: str, schedule: DecodeSchedule):
    lengths, num_samples, sampling, limits = CASES[case]
    return generate(model, random_prompts(lengths), num_samples=num_samples, sampling=sampling, seed=5,
                    return_hidden=True, max_new_tokens_per_completion=limits, schedule=schedule)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_schedule_gives_the_reference_completions(qwen2, case):
    reference = run(qwen2, case, REFERENCE)
    assert reference.stats.num_idle_steps == 0
    for schedule in SCHEDULES:
        other = run(qwen2, case, schedule)
        assert [t.tolist() for t in other.tokens] == [t.tolist() for t in reference.tokens], schedule
        assert other.finish_reasons == reference.finish_reasons
        for ours, theirs in zip(other.logprobs + other.hidden, reference.logprobs + reference.hidden):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        assert other.stats.live_batch_sizes == reference.stats.live_batch_sizes
        assert other.stats.num_forwards == reference.stats.num_forwards
        assert other.stats.num_idle_steps < schedule.host_check_every
    if case == "all finishing in one step":
        assert [len(t) for t in reference.tokens] == [3] * 6 and reference.stats.live_batch_sizes == [6, 6]
    if case == "stops inside the window":
        assert len({len(t) for t in reference.tokens}) > 3, "the case needs varied lengths"


def test_the_window_runs_masked_steps_after_a_stop(qwen2):
    """With k = 32 every row that stops early waits masked in the batch: its extra draws are dropped."""
    rollout = run(qwen2, "stops inside the window", DecodeSchedule(32, "pow2"))
    lengths = [len(t) for t in rollout.tokens]
    assert min(lengths) < max(lengths) - 2  # rows finished inside the window and were not retired
    assert rollout.stats.num_idle_steps == 15 - (max(lengths) - 1)  # steps run past the last stop


def test_power_of_two_buckets_retire_rows_only_when_the_bucket_shrinks(qwen2, monkeypatch):
    retirements = []
    keep = DecodeState.keep

    def recording_keep(self, rows):
        retirements.append((len(self.next_B), len(rows)))
        keep(self, rows)

    monkeypatch.setattr(DecodeState, "keep", recording_keep)
    rollout = run(qwen2, "stops inside the window", DecodeSchedule(1, "pow2"))
    lengths = [len(t) for t in rollout.tokens]
    expected, batch = [], len(lengths)
    for steps_run in range(max(lengths)):  # host check after steps_run steps: done iff length <= steps_run + 1
        num_live = sum(n > steps_run + 1 for n in lengths)
        if num_live and (size := 1 << (num_live - 1).bit_length()) < batch:
            expected.append((batch, size))
            batch = size
    assert retirements == expected and len(expected) >= 2
    assert all(size & (size - 1) == 0 for _, size in retirements)


def test_buckets_and_the_rows_kept_by_hand():
    assert [BUCKETS["pow2"](n, 12) for n in (12, 9, 8, 5, 4, 3, 1)] == [12, 12, 8, 8, 4, 4, 1]
    assert [BUCKETS["exact"](n, 12) for n in (12, 5, 1)] == [12, 5, 1]
    # step8: multiples of 8 above 8 live rows, powers of two below, never more than the batch.
    assert [BUCKETS["step8"](n, 64) for n in (64, 60, 57, 56, 33, 17, 9, 8, 5, 3, 1)] == \
        [64, 64, 64, 56, 40, 24, 16, 8, 8, 4, 1]
    assert BUCKETS["step8"](11, 12) == 12
    # Live rows 1 and 4, padded with the first finished rows (0, 2) to 4 rows, in batch order.
    assert _rows_to_keep([True, False, True, True, False, True], 4) == [0, 1, 2, 4]
    assert _rows_to_keep([True, False, True], 1) == [1]


@pytest.mark.parametrize("arch", ["qwen2", "mistral-window"])
def test_the_plain_step_never_syncs_with_the_host(arch, qwen2, monkeypatch):
    model = qwen2 if arch == "qwen2" else build_model("mistral", seed=2, sliding_window=4)
    forbid_host_syncs_inside(monkeypatch, (PlainStep, "__call__"))
    for schedule in (REFERENCE, DecodeSchedule(4, "pow2")):
        rollout = generate(model, random_prompts([5, 9]), num_samples=3, seed=1, return_hidden=True,
                           sampling=SamplingConfig(max_new_tokens=10, top_p=0.9, stop_token_ids=STOPS),
                           schedule=schedule)
        assert rollout.stats.num_forwards > 3


@pytest.mark.parametrize("sampling", [SamplingConfig(max_new_tokens=8),
                                      SamplingConfig(max_new_tokens=8, temperature=0)], ids=["sampled", "greedy"])
@pytest.mark.parametrize("schedule", [REFERENCE, DecodeSchedule(4, "pow2")], ids=["k1", "k4"])
def test_non_finite_logits_are_named_as_such(sampling, schedule):
    model = build_model("qwen2")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="logits are not finite"):
        generate(model, random_prompts([5, 9]), num_samples=2, sampling=sampling, seed=0, schedule=schedule)


def test_a_runs_compiled_step_retires_rows_by_the_compiled_buckets():
    """rollout.step_runner: a compiled runner gets ``COMPILED_BUCKETS`` (exact retirement would compile a graph per
    live count); eager keeps the CPU's exact retirement, and "auto" gets the buckets where it picks a compiled step."""
    cpu = torch.device("cpu")
    assert run_schedule(cpu, linears="module", runner="compiled-onednn").buckets == COMPILED_BUCKETS == "step8"
    assert run_schedule(cpu, linears="module", runner="compiled").runner == "compiled"
    assert run_schedule(cpu, linears="onednn", runner="eager") == DecodeSchedule(1, "exact", "eager", "onednn")
    assert run_schedule(cpu, linears="module", runner="auto").buckets == "exact"


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="host_check_every"):
        DecodeSchedule(host_check_every=0)
    with pytest.raises(ValueError, match="buckets"):
        DecodeSchedule(buckets="fibonacci")
    with pytest.raises(ValueError, match="schedule"):
        generate(build_model("qwen2"), random_prompts([3]), num_samples=1, sampling=SamplingConfig(max_new_tokens=2),
                 schedule=4)
