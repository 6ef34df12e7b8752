"""docs/design/async.md's cost-model table is what scripts/async_cost_model.py makes now, and the model's
algebra holds on hand-computed cases."""

import json

import pytest

from tests.docs.test_generated_pages import script

cost_model = script("async_cost_model")


def test_the_async_page_table_is_current():
    page = cost_model.PAGE.read_text(encoding="utf-8")
    assert page == cost_model.render(page), "docs/design/async.md is out of date: run scripts/async_cost_model.py"


def test_overlap_on_split_pools_gains_nothing_with_ideal_scaling():
    # r = 0.5, no knee floor, no push, 8 GPUs: on-policy R + U = 0.5 T + 0.5 T; k = 1 gives each half 4 GPUs,
    # so each phase takes twice as long and the overlapped step is again T (a model that overlapped the
    # phases on all N GPUs at once would claim 2x).
    shape = cost_model.Shape("even", 0.5, 1.0, "hand")
    cost = cost_model.step_cost(shape, 8, step_s=100.0, push_s=0.0, knee_ratio=1e9)
    assert cost.on_policy_s == pytest.approx(100.0)
    assert cost.k1.seconds == pytest.approx(100.0) and cost.k1.rollout_gpus == 4


def test_the_knee_floor_and_partial_rollouts_by_hand():
    # r = 0.5, c = 4 (floor R = 0.5 T / 4 = 12.5 s), 512 GPUs, T = 100 s, push 1 s:
    #   on-policy: R = 12.5, U = 50 * 8 / 512 = 0.78125 -> 13.28125 s
    #   k = 1: a 32-GPU rollout pool reaches the floor, 480 GPUs update in 0.8333 s -> 12.5 + 1 = 13.5 s
    #   k = 1 + partial (u = 0.5): 6.25 + 1 = 7.25 s, bounded by the longest generation's floor
    shape = cost_model.Shape("floor", 0.5, 0.5, "hand")
    cost = cost_model.step_cost(shape, 512, step_s=100.0, push_s=1.0, knee_ratio=4.0)
    assert cost.on_policy_s == pytest.approx(12.5 + 0.78125)
    assert cost.k1.seconds == pytest.approx(13.5) and cost.k1.rollout_gpus == 32
    assert cost.k1_partial.seconds == pytest.approx(7.25)
    assert cost.k1_partial.bound == "longest generation (knee floor)"
    pushed = cost_model.step_cost(shape, 512, step_s=100.0, push_s=5.0, knee_ratio=4.0)
    assert pushed.k1_partial.bound == "weight push"  # 5 s of an 11.25 s step


def test_measured_shapes_read_the_split_and_the_occupancy(tmp_path):
    files = {
        "e2e_smollm2-zero-shot.json": {"shapes": [{"phases_s": {"turbogrpo": {"rollout": 30.0, "update": 50.0,
                                                                             "logprobs": 20.0}},
                                                   "mean_completion_tokens_turbogrpo": 96.0, "max_new_tokens": 128}]},
        "multiturn_smollm2_calculator.json": {"step": {"phases_s": {"turbogrpo": {"rollout": 10.0, "update": 30.0,
                                                                                 "logprobs": 0.0}},
                                                       "shape": {"max_conversation_tokens": 100},
                                                       "turbogrpo_completion_length": 25.0}},
        "rollout.json": {"long_tail": {"live_batch_row_steps": 300, "padded_batch_row_steps": 1200}},
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    gsm8k, calculator, tail = cost_model.measured_shapes(tmp_path)
    assert (gsm8k.rollout_share, gsm8k.occupancy) == (0.3, 0.75)  # old-policy scoring counts as update
    assert (calculator.rollout_share, calculator.occupancy) == (0.25, 0.25)
    assert tail.occupancy == 0.25 and tail.rollout_share == cost_model.ASSUMPTIONS["published_rollout_share"][0]
