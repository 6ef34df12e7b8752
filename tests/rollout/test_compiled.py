"""The plain step as one graph: torch.compile(fullgraph=True) captures it, it is not compiled again
while the live batch shrinks within a bucket or for the next rollout, and it runs no more operators
per decoder layer than Hugging Face's own eager decoding step."""

import os
import sys
import time
from collections import Counter
from unittest import mock

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from tests.rollout.conftest import build_model, random_prompts
from turbogrpo.rollout import SamplingConfig, cpu_attention, generate
import turbogrpo.cache
import turbogrpo.rollout.compiled as compiled_module
from turbogrpo.rollout.compiled import (COMPILE_CACHE_ENV, SLOT_BLOCK, _compiled, compile_cache_folder, physical_cores,
                                        pinned_threads, resolve_runner, use_compile_cache)
from turbogrpo.rollout.decode import COMPILED_BUCKETS, DecodeSchedule, _probe_rollout, _step8_bucket, first_draw
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.rollout.step import PlainStep, plain_step

# Operators that only make a view or change metadata launch no kernel and are not counted.
VIEW_OPS = {"aten::view", "aten::flatten", "aten::unsqueeze", "aten::slice", "aten::transpose", "aten::expand",
            "aten::expand_as", "aten::alias", "aten::reshape", "aten::select", "aten::squeeze", "aten::as_strided",
            "aten::t", "aten::contiguous", "aten::detach", "aten::lift_fresh", "aten::_unsafe_view",
            "aten::unbind", "aten::view_as", "aten::split", "aten::chunk", "aten::narrow", "aten::permute",
            "aten::empty", "aten::empty_like"}
EXTRA_OPS_PER_LAYER = 6  # the two attention parts and their merge, against one SDPA


def test_the_plain_step_is_one_graph_reused_within_a_bucket_and_across_rollouts():
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("qwen2", num_hidden_layers=1)
    sampling = SamplingConfig(max_new_tokens=6)
    # Limits 5, 6, 6, 6: the live batch goes 4, 4, 4, 4, 3 -- always within the bucket of 4.
    kwargs = dict(num_samples=4, sampling=sampling, seed=1, max_new_tokens_per_completion=[5, 6, 6, 6])
    eager = generate(model, random_prompts([5]), schedule=DecodeSchedule(2, "pow2"), **kwargs)
    counters.clear()
    compiled = generate(model, random_prompts([5]), schedule=DecodeSchedule(2, "pow2", "dynamo"), **kwargs)
    assert compiled.stats.live_batch_sizes == [4, 4, 4, 4, 3]
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # fullgraph: one graph
    counters.clear()
    again = generate(model, random_prompts([5]), schedule=DecodeSchedule(2, "pow2", "dynamo"), **kwargs)
    assert [t.tolist() for t in again.tokens] == [t.tolist() for t in eager.tokens]
    assert not counters["stats"] and not counters["recompiles"]  # the next rollout reuses the graph


def kernel_ops(work) -> int:
    """Top-level aten operators that launch work, in one call of ``work``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in VIEW_OPS:
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is not None:
            continue  # called by another aten operator
        if event.name == "aten::to" and not any(c.name == "aten::_to_copy" for c in event.cpu_children):
            continue  # a no-op conversion
        count += 1
    return count


def ops_per_layer(num_layers: int) -> tuple[int, int]:
    """(ours, HF's) operators of one greedy decoding step, 6 sequences of 2 prompts."""
    model = build_model("qwen2", num_hidden_layers=num_layers)
    prompts = random_prompts([5, 5])
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    with torch.no_grad():
        state = first_draw(model, prompts, 3, sampling, None, False, [12] * 6, 0)
        step = PlainStep()
        step(state)  # past the first step's one-time work
        ours = kernel_ops(lambda: step(state))
        cache = DynamicCache(config=model.config)
        tokens = model(torch.stack(prompts).repeat_interleave(3, 0), past_key_values=cache).logits[:, -1:].argmax(-1)
        model(tokens, past_key_values=cache)
        hf = kernel_ops(lambda: model(tokens, past_key_values=cache).logits[:, -1].argmax(-1))
    return ours, hf


def test_a_plain_step_runs_about_as_many_operators_per_layer_as_hf_decoding():
    (ours_2, hf_2), (ours_4, hf_4) = ops_per_layer(2), ops_per_layer(4)
    ours, hf = (ours_4 - ours_2) / 2, (hf_4 - hf_2) / 2
    assert ours <= hf + EXTRA_OPS_PER_LAYER, (ours, hf)


def test_the_cuda_graph_runners_are_refused_off_cuda():
    for runner in ("cudagraph", "compiled-cudagraph"):
        with pytest.raises(ValueError, match="needs a model on a CUDA device"):
            generate(build_model("qwen2", num_hidden_layers=1), random_prompts([5]), num_samples=2,
                     sampling=SamplingConfig(max_new_tokens=3), schedule=DecodeSchedule(2, "pow2", runner))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_gives_the_eager_tokens_across_buckets_and_rollouts():
    model = build_model("qwen2").cuda()
    prompts = [p.cuda() for p in random_prompts([5, 9])]
    # Limits spread so that the batch of 8 retires to buckets of 4, 2 and 1 while it decodes.
    kwargs = dict(num_samples=4, seed=3, return_hidden=True, max_new_tokens_per_completion=[2, 3, 5, 6, 9, 12, 12, 3],
                  sampling=SamplingConfig(max_new_tokens=12, top_p=0.9))
    eager = generate(model, prompts, schedule=DecodeSchedule(2, "pow2"), **kwargs)
    for _ in range(2):  # a second rollout records its own graphs
        replayed = generate(model, prompts, schedule=DecodeSchedule(2, "pow2", "cudagraph"), **kwargs)
        assert [t.tolist() for t in replayed.tokens] == [t.tolist() for t in eager.tokens]
        for ours, theirs in zip(replayed.logprobs + replayed.hidden, eager.logprobs + eager.hidden):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_the_inductor_compiled_step_gives_the_eager_tokens_with_grouped_query_heads():
    """Inductor may lay the merged attention output out with other strides than eager does (SmolLM2's
    9 query / 3 KV heads failed on a ``view``): the compiled runner must still give the eager tokens.
    The second rollout's other prompt lengths recompile the step with a dynamic prompt width, where
    inductor once failed to bind that size (``NameError: s65``) when the prompt mask was built from a
    host int inside the graph. 24 rows x 2 KV heads of head dim 64 run the own-completion part by the CPU kernel
    (``attention.KERNEL_ITEMS`` in float32), whose outputs the graph reads with its own strides, and the prompt part
    too (``attention.prompt_attention_for``), through a sliding window of 4 that hides a whole prompt from the later
    tokens (rows that see no prompt key)."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("mistral", num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                        head_dim=64, sliding_window=4)
    kwargs = dict(num_samples=12, sampling=SamplingConfig(max_new_tokens=8), seed=3)
    kernel_calls = []
    real_kernel = cpu_attention._kernel
    with mock.patch.object(cpu_attention, "_kernel", lambda dtype: (kernel_calls.append(dtype), real_kernel(dtype))[1]):
        for lengths in ([5, 7], [9, 4]):
            eager = generate(model, random_prompts(lengths), schedule=DecodeSchedule(1, "pow2"), **kwargs)
            compiled = generate(model, random_prompts(lengths), schedule=DecodeSchedule(1, "pow2", "compiled"),
                                **kwargs)
            assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    assert kernel_calls and set(kernel_calls) == {torch.float32}


def test_the_static_step_compiles_one_graph_per_bucket_and_reuses_it_for_new_prompts():
    """dynamic=False: the batch size is never a dynamic size, and the query block is sized by the batch alone, so
    there is one graph per bucket of the live batch, whichever groups are still live; the prompt width is a
    dynamic size, so rollouts of other prompt lengths reuse every graph. Tokens and log-probs are eager's."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("qwen2", num_hidden_layers=1)
    # The batch of 8 retires to buckets of 4 and 2; the group that finishes first changes between rollouts.
    limits = ([2, 3, 5, 6, 9, 12, 12, 3], [9, 12, 12, 3, 2, 3, 5, 6], [2, 12, 5, 6, 9, 3, 12, 3])
    for rollout, (lengths, limit) in enumerate(zip(([5, 5], [9, 9], [7, 7]), limits)):
        kwargs = dict(num_samples=4, sampling=SamplingConfig(max_new_tokens=12), seed=3,
                      max_new_tokens_per_completion=limit)
        eager = generate(model, random_prompts(lengths), schedule=DecodeSchedule(1, "pow2"), **kwargs)
        counters.clear()
        compiled = generate(model, random_prompts(lengths), schedule=DecodeSchedule(1, "pow2", "dynamo"), **kwargs)
        assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
        for ours, theirs in zip(compiled.logprobs, eager.logprobs):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
        if rollout:  # new prompt widths, other live groups, the same buckets: nothing compiles again
            assert not counters["stats"]["unique_graphs"] and not counters["recompiles"]
    buckets = _compiled(plain_step, "eager", static=True).compile_seconds
    assert sorted(bucket[0] for bucket in buckets) == [2, 4, 8]  # one graph each


def staggered_rows() -> tuple:
    """A fresh compile state and 8 prompts x 4 samples of staggered lengths (1-12 new tokens): the model, the prompts
    and ``generate``'s other arguments."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    kwargs = dict(num_samples=4, sampling=SamplingConfig(max_new_tokens=12), seed=4,
                  max_new_tokens_per_completion=[1 + (5 * i) % 12 for i in range(32)])
    return build_model("qwen2", num_hidden_layers=1), random_prompts([5, 7, 6, 5, 8, 5, 6, 7]), kwargs


def test_step8_buckets_retire_rows_in_eights_with_the_eager_tokens():
    """A compiled step retiring rows by "step8" (``COMPILED_BUCKETS``): 32 rows of staggered lengths meet buckets pow2
    never makes (24), and the tokens and log-probs are eager's."""
    model, prompts, kwargs = staggered_rows()
    eager = generate(model, prompts, schedule=DecodeSchedule(1, "exact"), **kwargs)
    compiled = generate(model, prompts, schedule=DecodeSchedule(1, COMPILED_BUCKETS, "dynamo"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    met = sorted({bucket[0] for bucket in _compiled(plain_step, "eager", static=True).compile_seconds})
    assert 24 in met and set(met) <= {32, 24, 16, 8, 4, 2, 1}, met


def test_timing_steps_keeps_each_warm_step_by_bucket():
    """``timing_steps``: inside the block every warm call of the compiled step is kept under its bucket (as many
    as the rollout ran in that bucket, each a positive time), a call that compiles is not, and outside the block
    nothing is kept."""
    model, prompts, kwargs = staggered_rows()
    schedule = DecodeSchedule(1, COMPILED_BUCKETS, "dynamo")
    step = _compiled(plain_step, "eager", static=True)
    with compiled_module.timing_steps(step) as cold:
        generate(model, prompts, schedule=schedule, **kwargs)  # compiles each bucket at its first step
    with compiled_module.timing_steps(step) as warm:
        rollout = generate(model, prompts, schedule=schedule, **kwargs)
    assert step.step_seconds is None
    generate(model, prompts, schedule=schedule, **kwargs)  # outside a block: kept nowhere
    steps_by_rows = Counter(_step8_bucket(live, 32) for live in rollout.stats.live_batch_sizes)
    assert {bucket[0]: len(times) for bucket, times in warm.items()} == steps_by_rows
    compiles = Counter(bucket[0] for bucket in step.compile_seconds)  # each bucket's first call: not kept
    assert Counter({bucket[0]: len(times) for bucket, times in cold.items()}) + compiles == steps_by_rows
    assert all(t > 0 for times in warm.values() for t in times) and set(warm) == set(step.compile_seconds)


def test_a_compiled_step_reads_the_slots_in_use_in_blocks_with_one_graph_per_bucket():
    """The generated slots a compiled step reads grow in blocks of SLOT_BLOCK as the rollout goes on (16, 32, 48 of
    a capacity of 40 here), a dynamic size of one graph: nothing compiles again, and the tokens and log-probs are
    eager's; a captured runner's steps read the whole capacity."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("llama", num_hidden_layers=1)
    kwargs = dict(num_samples=2, sampling=SamplingConfig(max_new_tokens=40), seed=3)
    eager = generate(model, random_prompts([5, 6]), schedule=DecodeSchedule(1, "exact"), **kwargs)
    read: list[int] = []  # the slots each step's graph reads
    real_call = compiled_module.CompiledStep.__call__
    with mock.patch.object(compiled_module.CompiledStep, "__call__",
                           lambda step, state: (read.append(state.cache.slot_index_L.shape[0]), real_call(step, state))):
        counters.clear()
        compiled = generate(model, random_prompts([5, 6]), schedule=DecodeSchedule(1, "exact", "dynamo"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert SLOT_BLOCK == 16 and read == [16] * 16 + [32] * 16 + [40] * 7  # 39 steps after the first draw
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    cache = GroupedKVCache([3, 4], 2, capacity=40, device=torch.device("cpu"), static_slots=True, slot_block=16)
    grown = []
    for length in range(40):
        cache.max_length = length
        grown.append(cache.slot_index(1).shape[0])
    assert grown == [16] * 16 + [32] * 16 + [40] * 8 and cache.dynamic_dims()[-1][0] is cache.slot_index_L
    assert DecodeSchedule(runner="compiled-cudagraph").slot_block is None
    assert DecodeSchedule(runner="compiled-onednn").slot_block == SLOT_BLOCK
    whole = GroupedKVCache([3, 4], 2, capacity=40, device=torch.device("cpu"), static_slots=True)
    whole.max_length = 3
    assert whole.slot_index(1).shape[0] == 40 and len(whole.dynamic_dims()) == 1


def test_the_inductor_step_reading_slots_in_blocks_gives_the_eager_tokens():
    """Inductor's graph over a dynamic number of generated slots, past two block boundaries: eager's tokens."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("llama", num_hidden_layers=1)
    kwargs = dict(num_samples=2, sampling=SamplingConfig(max_new_tokens=36), seed=6)
    eager = generate(model, random_prompts([4, 7]), schedule=DecodeSchedule(1, "exact"), **kwargs)
    compiled = generate(model, random_prompts([4, 7]), schedule=DecodeSchedule(1, "exact", "compiled"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert len(_compiled(plain_step, "inductor", static=True).compile_seconds) == 1


def test_a_model_in_another_dtype_has_its_own_graphs_on_record():
    """The same bucket in float32 and then float64 is two graphs (dynamo guards on the dtype), and both are on record:
    the second compile shows its progress line and its time, which benchmarks report."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("qwen2", num_hidden_layers=1)
    _probe_rollout(model, "dynamo", new_tokens=3)
    _probe_rollout(model.double(), "dynamo", new_tokens=3)
    buckets = _compiled(plain_step, "eager", static=True).compile_seconds
    assert sorted(str(bucket[-1]) for bucket in buckets) == ["torch.float32", "torch.float64"]
    assert len({bucket[:-1] for bucket in buckets}) == 1


def test_the_static_query_block_holds_uneven_groups_and_prompts():
    """Groups of unequal prompts retiring unevenly (the padded query block, its spare prompt rows): eager's tokens."""
    model = build_model("llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    kwargs = dict(num_samples=3, sampling=SamplingConfig(max_new_tokens=10, top_p=0.9), seed=5,
                  max_new_tokens_per_completion=[1, 2, 10, 4, 10, 3, 2, 8, 1])
    eager = generate(model, random_prompts([3, 9, 6]), schedule=DecodeSchedule(1, "exact"), **kwargs)
    static = generate(model, random_prompts([3, 9, 6]), schedule=DecodeSchedule(1, "exact", "dynamo"), **kwargs)
    assert [t.tolist() for t in static.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(static.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


# slow: ~50 s on 2 loaded cores for one inductor compile of a bf16 step; the inductor runner's path (float32, grouped
# query heads, a recompile for new prompt widths) is test_the_inductor_compiled_step_gives_the_eager_tokens_...
@pytest.mark.slow
def test_the_inductor_step_matches_eager_greedy_and_log_probs_in_bfloat16():
    """Greedy tokens equal eager's token for token; the sampler log-probs within bf16's rounding."""
    torch._dynamo.reset()
    _compiled.cache_clear()
    model = build_model("llama", num_hidden_layers=1).to(torch.bfloat16)
    kwargs = dict(num_samples=2, sampling=SamplingConfig(max_new_tokens=5, temperature=0.0), seed=4)
    eager = generate(model, random_prompts([5, 7]), schedule=DecodeSchedule(1, "pow2"), **kwargs)
    compiled = generate(model, random_prompts([5, 7]), schedule=DecodeSchedule(1, "pow2", "compiled"), **kwargs)
    assert [t.tolist() for t in compiled.tokens] == [t.tolist() for t in eager.tokens]
    for ours, theirs in zip(compiled.logprobs, eager.logprobs):
        torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.02)


def test_compiled_kernels_are_cached_in_turbogrpos_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(compiled_module, "USER_COMPILE_CACHE", None)
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    folder = use_compile_cache()
    assert folder == compile_cache_folder() and folder.is_relative_to(tmp_path) and folder.is_dir()
    assert os.environ[COMPILE_CACHE_ENV] == str(folder)
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "mine"))  # the user's own choice is kept
    assert use_compile_cache() == tmp_path / "mine"
    monkeypatch.setattr(compiled_module, "USER_COMPILE_CACHE", str(tmp_path / "at start"))  # as the process began
    assert use_compile_cache() == tmp_path / "at start"


def test_a_compile_after_vllm_set_its_own_inductor_folder_goes_to_turbogrpos_and_leaves_vllms_set(
        tmp_path, monkeypatch):
    """Building vLLM points TORCHINDUCTOR_CACHE_DIR at a per-model folder of its own; the compiled step's graphs
    went there, so a process without that vLLM build compiled them all again (65-71 s a bucket for SmolLM2)."""
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(compiled_module, "USER_COMPILE_CACHE", None)
    vllms = tmp_path / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "0123abcd" / "inductor_cache"
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(vllms))
    torch._dynamo.reset()
    _compiled.cache_clear()
    counters.clear()
    model = build_model("llama", num_hidden_layers=1)
    generate(model, random_prompts([5]), num_samples=2, sampling=SamplingConfig(max_new_tokens=3), seed=0,
             schedule=DecodeSchedule(1, "pow2", "compiled"))
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    assert any((compile_cache_folder() / "fxgraph").rglob("*")) and not any(vllms.rglob("*"))
    assert os.environ[COMPILE_CACHE_ENV] == str(vllms)  # vLLM's own compiles still read theirs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is read from /proc")
def test_pinned_threads_put_each_openmp_thread_on_its_own_core_for_the_block_only():
    torch.ones(1 << 16).sum()  # torch's thread pool exists
    allowed = os.sched_getaffinity(0)

    def affinities() -> list[set[int]]:
        return [os.sched_getaffinity(int(task)) for task in os.listdir("/proc/self/task")]
    with pinned_threads():
        pinned = [a for a in affinities() if len(a) == 1]
        assert os.sched_getaffinity(0) == {min(physical_cores(sorted(allowed)))}  # the main thread is thread 0
        assert len(pinned) >= min(torch.get_num_threads(), len(physical_cores(sorted(allowed))))
    assert all(a == allowed for a in affinities())


def test_auto_runner_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(turbogrpo.cache, "_MEASURED", {})
    calls = []
    monkeypatch.setattr(compiled_module, "_timed_runner", lambda rollout, compiled: calls.append(rollout) or "eager")
    model = build_model("qwen2", num_hidden_layers=1)
    probe = lambda runner: None  # noqa: E731
    assert resolve_runner("auto", model, probe) == "eager" and resolve_runner("compiled", model, probe) == "compiled"
    monkeypatch.setattr(turbogrpo.cache, "_MEASURED", {})  # another process: reads the stored choice
    assert resolve_runner("auto", model, probe) == "eager" and len(calls) == 1
    kwargs = dict(num_samples=2, sampling=SamplingConfig(max_new_tokens=4), seed=2)
    auto = generate(model, random_prompts([5]), schedule=DecodeSchedule(runner="auto"), **kwargs)
    eager = generate(model, random_prompts([5]), schedule=DecodeSchedule(), **kwargs)
    assert [t.tolist() for t in auto.tokens] == [t.tolist() for t in eager.tokens]
    with pytest.raises(ValueError, match="runner must be one of"):
        DecodeSchedule(runner="fast")


def test_the_measurement_picks_the_faster_runner():
    assert compiled_module._timed_runner(lambda runner: time.sleep(0.02 if runner == "eager" else 0.0)) == "compiled"
    assert compiled_module._timed_runner(lambda runner: time.sleep(0.02 if runner == "compiled" else 0.0)) == "eager"
    assert compiled_module._timed_runner(lambda runner: time.sleep(0.02 if runner == "eager" else 0.0),
                                         "compiled-onednn") == "compiled-onednn"


def test_auto_times_the_packed_compiled_runner_where_onednn_measured_faster_here(monkeypatch):
    model = build_model("qwen2", num_hidden_layers=1)
    for faster, expected in ((True, "compiled-onednn"), (False, "compiled")):
        monkeypatch.setattr(compiled_module, "onednn_is_faster", lambda dtype, threads: faster)
        assert compiled_module.compiled_candidate(model) == expected
    _probe_rollout(build_model("qwen2", num_hidden_layers=1), "eager")  # what "auto" times, here eager
