"""A TRL user's vLLM importance-sampling setting becomes turbogrpo's [algo] correction one to one.

``off_policy_correction_of(GRPOConfig)`` names the same mode with the same bounds, and the weights our loss then
applies are the ones TRL's own formula gives for that GRPOConfig, on the golden tensors of
tests/algo/test_corrections.py.
"""

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")

from tests.algo.test_corrections import EXACT, golden_tensors, trl_importance_sampling_ratio, weights_of  # noqa: E402
from turbogrpo.config import AlgoConfig  # noqa: E402
from turbogrpo.integrations.trl import TRL_IMPORTANCE_SAMPLING_MODES, off_policy_correction_of  # noqa: E402


def grpo_config(tmp_path, **kwargs):
    return trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], use_vllm=True, **kwargs)


def test_trls_default_is_the_sequence_mask_at_3(tmp_path):
    assert off_policy_correction_of(grpo_config(tmp_path)) == {"off_policy_correction": "sequence_mask",
                                                               "tis_cap": 3.0, "tis_cap_low": 0.0}


@pytest.mark.parametrize("clip_min, clip_max", [(None, 2.0), (0.5, 3.0), (0.25, None)])
@pytest.mark.parametrize("mode", TRL_IMPORTANCE_SAMPLING_MODES)
def test_each_mode_and_bound_maps_to_the_same_weights(tmp_path, mode, clip_min, clip_max):
    args = grpo_config(tmp_path, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                       vllm_importance_sampling_clip_max=clip_max)
    settings = off_policy_correction_of(args)
    assert settings == {"off_policy_correction": mode, "tis_cap": float("inf") if clip_max is None else clip_max,
                        "tis_cap_low": clip_min or 0.0}
    algo = AlgoConfig(**settings)
    algo.check("algo")  # a valid [algo] section
    prox, behav, mask = golden_tensors(seed=2)
    theirs = trl_importance_sampling_ratio(prox, behav, mask, args.vllm_importance_sampling_mode,
                                           args.vllm_importance_sampling_clip_min,
                                           args.vllm_importance_sampling_clip_max).expand_as(mask)
    ours, _ = weights_of(algo.off_policy_correction, prox - behav, mask, high=algo.tis_cap, low=algo.tis_cap_low)
    torch.testing.assert_close(ours * mask, theirs * mask, **EXACT)


def test_the_deprecated_cap_is_the_upper_bound(tmp_path):
    with pytest.warns(FutureWarning):
        args = grpo_config(tmp_path, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_cap=2.0)
    assert off_policy_correction_of(args) == {"off_policy_correction": "token_truncate", "tis_cap": 2.0,
                                              "tis_cap_low": 0.0}


@pytest.mark.parametrize("kwargs", [{"use_vllm": False}, {"vllm_importance_sampling_correction": False}])
def test_no_correction_in_trl_is_none_here(tmp_path, kwargs):
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                          **{"use_vllm": True, **kwargs})
    assert off_policy_correction_of(args)["tis_cap"] == 0.0


def test_what_has_no_equal_is_refused(tmp_path):
    with pytest.raises(ValueError, match="off_policy_mask_threshold=0.5 .* has no turbogrpo setting"):
        off_policy_correction_of(grpo_config(tmp_path, off_policy_mask_threshold=0.5))
    args = grpo_config(tmp_path)
    args.vllm_importance_sampling_mode = "token"
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token' is not one of TRL's"):
        off_policy_correction_of(args)
