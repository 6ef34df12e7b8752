"""The rollout engine's one decoding loop, for plain and speculative steps alike.

    prefill (one forward over the distinct prompts)
      -> every sample draws its own first token from its prompt's logits
      -> loop: a window of ``host_check_every`` steps with no host sync (``step.py``),
               then one host read: finished rows, live counts, non-finite logits, the step's values;
               retire finished rows when the live count falls to a smaller bucket

The step is a ``DecodeStep``: the plain step, or whatever ``draft.make_step(...)`` returns (the
speculative tree step of ``turbogrpo.speculative``; the engine never imports it). Finished rows stay
in the batch until their bucket empties, masked (``emit`` gives them nothing), so that within a
bucket every step has the same shapes.

The policy runs as the user's own ``transformers`` model object (through ``turbogrpo.hook``), so a
rollout right after an optimizer step already uses the new weights.

Legend: ``N`` completions, ``B`` rows of the decoding batch, ``G`` prompts, ``P`` longest prompt,
``V`` vocabulary, ``Hd`` hidden size.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from turbogrpo.architectures import hybrid_layers
from turbogrpo.hook import check_materialized, embedding_table
from turbogrpo.host_memory import keep_freed_host_memory
from turbogrpo.output_head import check_logits_head, logits_head
from turbogrpo.rollout.compiled import (CAPTURED_RUNNERS, PLAIN_RUNNERS, RUNNER_NAMES, SLOT_BLOCK,
                                        STACKED_PRODUCT_RUNNERS, resolve_runner, runner_scope)
from turbogrpo.rollout.kv_cache import GroupedKVCache
from turbogrpo.graph_linears import GRAPH_LINEAR_KERNELS
from turbogrpo.linears import LINEAR_KERNELS
from turbogrpo.moe_routes import RouteLog, RouteRecorder, maybe_recording, maybe_replaying, padded_routes
from turbogrpo.rollout.outputs import LiveRows, OutputBuffers, collect_rollout, emit
from turbogrpo.rollout.plans import prefill_all_positions
from turbogrpo.rollout.sampling import SamplingConfig, at_least_float32
from turbogrpo.rollout.step import DecodeState, DecodeStep, PlainStep, plain_step
from turbogrpo.rollout.stopping import StopCriteria
from turbogrpo.rollout.types import Rollout, RolloutStats


def _exact_bucket(num_live: int, batch_size: int) -> int:
    return num_live


def _power_of_two_bucket(num_live: int, batch_size: int) -> int:
    return min(batch_size, 1 << max(0, num_live - 1).bit_length())


STEP = 8
"""Row granularity of the "step8" buckets above ``STEP`` live rows."""


def _step8_bucket(num_live: int, batch_size: int) -> int:
    if num_live <= STEP:
        return _power_of_two_bucket(num_live, batch_size)
    return min(batch_size, -(-num_live // STEP) * STEP)


BUCKETS: dict[str, Callable[[int, int], int]] = {"exact": _exact_bucket, "pow2": _power_of_two_bucket,
                                                  "step8": _step8_bucket}
"""Batch size to keep for ``num_live`` live rows in a batch of ``batch_size``: "exact" retires every
finished row at each host check; "pow2" only when the live count falls to a smaller power of two,
so that a step's shapes change at most log2(N) times per rollout (one captured graph per bucket); "step8"
in steps of 8 rows above 8 live rows and by powers of two below: at most N / 8 + 3 graphs, and at most 7 finished
rows carried. A compiled SmolLM2 rollout of 8 GSM8K prompts x 8 up to 256 tokens met one pow2 bucket only (more than 32
rows stayed live to the last step), so all 64 rows ran to the end for about 13.8k tokens in 16.3k row-steps."""

COMPILED_BUCKETS = "step8"
"""The buckets a compiled plain step retires rows by (one static graph per bucket)."""


@dataclass(frozen=True)
class DecodeSchedule:
    """When the host looks at the decoding batch."""

    host_check_every: int = 1
    """Steps run back to back between host reads (>= 1). Each read waits for the device; a larger k
    hides that wait but runs finished rows up to k - 1 extra (masked) steps."""
    buckets: str = "exact"
    """Key of ``BUCKETS``: when finished rows are retired."""
    runner: str = "eager"
    """Key of ``compiled.PLAIN_RUNNERS``: how the plain step runs (eager, compiled by ``torch.compile``, or
    replayed from CUDA graphs: opt-in, CUDA only, not yet measured; see ``turbogrpo.rollout.compiled``), or
    "auto": the faster of eager and compiled here, by measurement (``compiled.resolve_runner``)."""
    linears: str = "auto"
    """Key of ``turbogrpo.linears.LINEAR_KERNELS``: how the weight matmuls run (the modules as they are, or on
    oneDNN-packed copies of the weights on the CPU; "auto" measures which is faster, and keeps the
    modules under a compiled or graph runner)."""

    def __post_init__(self):
        if isinstance(self.host_check_every, bool) or not isinstance(self.host_check_every, int) \
                or self.host_check_every < 1:
            raise ValueError(f"DecodeSchedule.host_check_every must be an integer >= 1, got "
                             f"{self.host_check_every!r}")
        if self.buckets not in BUCKETS:
            raise ValueError(f"DecodeSchedule.buckets must be one of {sorted(BUCKETS)}, got {self.buckets!r}")
        if self.runner not in RUNNER_NAMES:
            raise ValueError(f"DecodeSchedule.runner must be one of {sorted(RUNNER_NAMES)}, got {self.runner!r}")
        if self.linears not in LINEAR_KERNELS:
            raise ValueError(f"DecodeSchedule.linears must be one of {sorted(LINEAR_KERNELS)}, got {self.linears!r}")
        if self.linears == "onednn" and self.runner not in ("eager", *STACKED_PRODUCT_RUNNERS):
            raise ValueError(f"DecodeSchedule.linears='onednn' runs with runner='eager' or "
                             f"{', '.join(repr(r) for r in sorted(STACKED_PRODUCT_RUNNERS))} only (got runner="
                             f"{self.runner!r}: the other compiled and graph runners trace the modules as they are)")

    @property
    def static_slots(self) -> bool:
        """Compiled steps attend over a number of KV slots that holds from step to step (a static shape, or
        a dynamic size of one graph: ``slot_block``)."""
        return self.runner != "eager"

    @property
    def slot_block(self) -> int | None:
        """Slots a compiled step's read grows by (``GroupedKVCache.slot_block``); None: eager (reads the slots
        in use) or a captured runner (reads the whole capacity)."""
        return None if self.runner == "eager" or self.runner in CAPTURED_RUNNERS else SLOT_BLOCK


DEFAULT_SCHEDULES = {
    # CPU: the host read costs nothing (the work already ran when the op returned) and a masked row
    # costs its full share of every op, so: read every step, retire at once. bench/rollout.py's
    # long-tail rollout (8 x 8, up to 256 tokens; 2-core CPU, one repeat), time against k=1 exact:
    # loaded machine k=4 exact 0.94x, k=1 pow2 1.03x, k=8 pow2 1.34x; quiet machine 1.05x, 1.07x,
    # 0.97x. Noise-level either way, so the simplest schedule stays.
    "cpu": DecodeSchedule(host_check_every=1, buckets="exact"),
    # GPU: a host read stalls the launch queue, and shapes should stay put for graph replay. Not yet
    # measured on a GPU (bench/gpu_rollout.py measures it).
    "cuda": DecodeSchedule(host_check_every=8, buckets="pow2"),
}


def default_schedule(device: torch.device) -> DecodeSchedule:
    return DEFAULT_SCHEDULES.get(device.type, DEFAULT_SCHEDULES["cuda"])


def run_schedule(device: torch.device, *, linears: str, runner: str) -> DecodeSchedule:
    """A training run's schedule: ``device``'s default with the run's weight-product kernels (model.linear_kernel)
    and plain-step runner (rollout.step_runner; a compiled one on the CPU retires rows by ``COMPILED_BUCKETS``, "auto"
    does where it picks one)."""
    schedule = dataclasses.replace(default_schedule(device), linears=linears, runner=runner)
    if runner in ("eager", "auto") or schedule.buckets != "exact":
        return schedule
    return dataclasses.replace(schedule, buckets=COMPILED_BUCKETS)


def generate(model: nn.Module, prompts: list[torch.Tensor], *, num_samples: int, sampling: SamplingConfig,
             seed: int | None = None, draft: object | None = None, return_hidden: bool = False,
             max_new_tokens_per_completion: Sequence[int] | None = None,
             schedule: DecodeSchedule | None = None,
             until: Callable[[list[bool]], bool] | None = None, record_routes: bool = False,
             prefix_routes: Sequence[torch.Tensor | None] | None = None) -> Rollout:
    """Sample ``num_samples`` completions for each prompt with ``model``'s current weights.

    ``prompts``: 1-D int64 token id tensors, one per group. ``seed`` makes the draws reproducible
    (a generator on the model's device); ``None`` uses torch's global generator. ``return_hidden``
    keeps the policy's final hidden state for every generated token. ``draft`` turns on lossless
    speculative decoding: any object with ``make_step(model, prompts, sampling) -> DecodeStep``
    (``turbogrpo.speculative.Speculation``; ``generate_speculative`` also takes a bare ``DraftHead``).
    ``max_new_tokens_per_completion``: a length limit for each completion (group by group, as in the
    output), each at most ``sampling.max_new_tokens``; None gives every completion that limit.
    ``schedule``: when the host checks the batch (None: the device's default, ``DEFAULT_SCHEDULES``);
    it changes speed only (its ``linears`` kernel rounds the weight matmuls' sums in another order,
    about 1e-6 relative in float32, as any two GEMM kernels do).
    ``until``: stop early (a partial rollout, ``train/worker/partial_rollouts.py``): called at every host check with
    which completions have finished (``[N]`` host bools); True ends the rollout there, and a completion still
    running keeps what it has drawn (finish reason "length", shorter than its limit). None: run to the end.
    ``record_routes``: keep the experts a mixture-of-experts policy's routers chose for every prompt and completion
    token (the rollout's ``routes`` / ``prompt_routes``, ``turbogrpo.moe_routes``; algo.routing_replay; a speculative
    rollout keeps the accepted path's); eager runners only. ``prefix_routes``: per prompt, the routes ``[R_g, L, k]``
    (R_g <= P_g; None: none) its first R_g tokens were run with before (a partial rollout's carried generation, drawn
    by older weights): the prefill replays them, so every token keeps the experts that ran it when it was drawn
    (``prompt_routes`` then holds them, and the routes the prefill chose for the rest).
    """
    _check_inputs(model, prompts, num_samples, sampling, check_positions=max_new_tokens_per_completion is None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be None or an integer in [0, 2**63), got {seed!r}")
    if schedule is not None and not isinstance(schedule, DecodeSchedule):
        raise ValueError(f"schedule must be a DecodeSchedule or None, got {type(schedule).__name__}")
    if draft is not None and not callable(getattr(draft, "make_step", None)):
        raise ValueError(f"draft must be a turbogrpo.speculative.Speculation (or None for plain sampling), got "
                         f"{type(draft).__name__}; wrap a DraftHead as Speculation(draft_head), or call "
                         "turbogrpo.speculative.generate_speculative, which takes either")
    # As in the trainer: called directly (the Python API), a rollout's large short-lived host tensors must
    # not page-fault in afresh at every step (host_memory.py; on by default, TURBOGRPO_HOST_MALLOC=system).
    keep_freed_host_memory()
    device = next(model.parameters()).device
    limits = _length_limits(max_new_tokens_per_completion, len(prompts) * num_samples, sampling)
    if max_new_tokens_per_completion is not None:  # each prompt needs room for its own completions' limit only
        _check_positions(model, prompts, [max(limits[g * num_samples:(g + 1) * num_samples])
                                          for g in range(len(prompts))], "its completions' limit")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    prompts = [p.to(device=device, dtype=torch.long) for p in prompts]
    # Outside inference mode even when the caller is in it: an inference tensor has no version counter,
    # which the packed kernel's sibling products check, and cannot be saved for a later backward (a
    # caller that trains on the rollout's tensors would fail there). no_grad keeps the rollout free.
    with torch.inference_mode(False), torch.no_grad():
        schedule = resolved_runner(schedule or default_schedule(device), model, record_routes)
        check_runner(model, schedule.runner)
        if record_routes:
            check_route_recording(draft, schedule)
        elif prefix_routes is not None:
            raise ValueError("generate: prefix_routes are replayed into a rollout that records its routes "
                             "(record_routes=True)")
        # The step is made inside: a speculative step may time the model (its latency profile) as it runs.
        with rollout_linear_kernel(schedule, draft)([model, *getattr(draft, "rollout_modules", list)()]), \
                maybe_recording(model, record_routes) as recorder, runner_scope(schedule.runner):
            step: DecodeStep = (PlainStep(PLAIN_RUNNERS[schedule.runner](plain_step)) if draft is None
                                else draft.make_step(model, prompts, sampling))
            return _rollout(model, prompts, num_samples, sampling, generator, return_hidden, limits, step,
                            schedule, until, recorder, prefix_routes)


def check_route_recording(draft: object | None, schedule: DecodeSchedule | None) -> None:
    """Routes are recorded by the plain and tree steps under the eager runner (its forward hooks run in Python)."""
    if getattr(draft, "runner", "eager") != "eager":
        raise ValueError(f"algo.routing_replay = \"replay\" records routes with the eager runner only, got the "
                         f"speculative runner {draft.runner!r} (a compiled step does not run the recording hooks)")
    if schedule is not None and schedule.runner != "eager":
        raise ValueError(f"algo.routing_replay = \"replay\" records routes with the eager runner only, got runner "
                         f"{schedule.runner!r} (a compiled or captured step does not run the recording hooks)")


def check_runner(model: nn.Module, runner: str) -> None:
    """ValueError in one line for a hybrid model under a runner that traces the step whole: its recurrent layers'
    units run outside any graph (``turbogrpo.hook``), which ``fullgraph`` compilation refuses and CUDA-graph capture
    has not been checked with."""
    if runner != "eager" and (layers := hybrid_layers(model.config)):
        raise ValueError(f"DecodeSchedule.runner={runner!r} traces the decoding step whole, but model type "
                         f"'{model.config.model_type}' has {layers}, whose units run eagerly: use runner='eager'")


def resolved_runner(schedule: DecodeSchedule, model: nn.Module, record_routes: bool = False) -> DecodeSchedule:
    """``schedule`` with runner "auto" resolved for ``model`` (``compiled.resolve_runner``); a compiled step
    chosen so retires rows by power-of-two buckets, one static graph each. Eager for a hybrid, or when MoE routes
    are recorded (``record_routes``: their hooks run in Python)."""
    if schedule.runner != "auto":
        return schedule
    if hybrid_layers(model.config) or record_routes:  # recurrent units and the route hooks run eagerly
        return dataclasses.replace(schedule, runner="eager")
    runner = resolve_runner(schedule.runner, model, functools.partial(_probe_rollout, model))
    return dataclasses.replace(schedule, runner=runner,
                               buckets=COMPILED_BUCKETS if runner != "eager" else schedule.buckets)


def _probe_rollout(model: nn.Module, runner: str, *, num_prompts: int = 2, num_samples: int = 4,
                   new_tokens: int = 24) -> None:
    """A greedy rollout of ``model`` with ``runner`` that "auto" times (random 16-token prompts, every completion
    ``new_tokens`` long, so one bucket holds throughout)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    prompts = [torch.randint(vocab, (16,), generator=generator).to(device) for _ in range(num_prompts)]
    generate(model, prompts, num_samples=num_samples, sampling=SamplingConfig(max_new_tokens=new_tokens, temperature=0.0),
             schedule=DecodeSchedule(1, COMPILED_BUCKETS, runner))


def rollout_linear_kernel(schedule: DecodeSchedule, draft: object | None = None):
    """The ``LINEAR_KERNELS`` entry to run the rollout's modules under (plain, speculative and multi-turn
    rollouts alike): "auto" keeps the modules as they are where a step is compiled or replayed (they trace
    the modules themselves); a plain step, or a speculative rollout's steps (``draft.runner``), whose graphs call
    ``graph_linears.stacked_linear`` (``STACKED_PRODUCT_RUNNERS``) run in the scope ``GRAPH_LINEAR_KERNELS`` gives
    instead."""
    graph_runner = schedule.runner if draft is None else getattr(draft, "runner", "eager")
    if graph_runner in STACKED_PRODUCT_RUNNERS:
        return GRAPH_LINEAR_KERNELS[schedule.linears]
    eager = schedule.runner == "eager" and getattr(draft, "runner", "eager") == "eager"
    if schedule.linears == "auto" and not eager:
        return LINEAR_KERNELS["module"]
    return LINEAR_KERNELS[schedule.linears]


def _length_limits(limits: Sequence[int] | None, num_completions: int, sampling: SamplingConfig) -> list[int]:
    """Most new tokens of each completion (host list)."""
    if limits is None:
        return [sampling.max_new_tokens] * num_completions
    limits = list(limits)
    if len(limits) != num_completions:
        raise ValueError(f"max_new_tokens_per_completion has {len(limits)} entries; it needs one per completion "
                         f"({num_completions} = prompts x num_samples)")
    bad = [n for n in limits if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= sampling.max_new_tokens]
    if bad:
        raise ValueError(f"max_new_tokens_per_completion holds {bad[:3]}; each must be an integer in "
                         f"[1, sampling.max_new_tokens={sampling.max_new_tokens}]")
    return limits


def _rollout(model: nn.Module, prompts: list[torch.Tensor], num_samples: int, sampling: SamplingConfig,
             generator: torch.Generator | None, return_hidden: bool, limits: list[int], step: DecodeStep,
             schedule: DecodeSchedule, until: Callable[[list[bool]], bool] | None = None,
             recorder: RouteRecorder | None = None, prefix_routes: Sequence[torch.Tensor | None] | None = None
             ) -> Rollout:
    """The loop of the module docstring (inputs already checked and on the model's device); ``recorder``: the
    routers' recording hooks, when the rollout keeps the routes (``prefix_routes``: replayed at the prefill)."""
    start = time.perf_counter()
    state = first_draw(model, prompts, num_samples, sampling, generator, return_hidden or step.keeps_hidden,
                       limits, step.extra_slots, static_slots=schedule.static_slots and not step.extra_slots,
                       slot_block=schedule.slot_block, recorder=recorder, prefix_routes=prefix_routes)
    stats = step.make_stats()
    stats.num_forwards += 1
    step.start(state)
    every = step.host_check_every or schedule.host_check_every
    bucket = BUCKETS["exact" if step.exact_compaction else schedule.buckets]
    # Every live row emits at least one token per step, so after max(limits) - 1 steps all are done.
    steps_left = max(limits) - 1
    steps_run, window = 0, 0
    # With ``until``: the completion of each batch row and which completions have finished (host lists; a
    # retired row's completion stays finished).
    row_completion, finished_N = list(range(len(limits))), [False] * len(limits)
    while True:
        done = _host_check(state, step, stats, steps_run - window, window)
        num_live = done.count(False)
        if num_live == 0:
            break
        if until is not None:
            for completion, finished in zip(row_completion, done):
                finished_N[completion] = finished
            if until(finished_N):
                break
        keep_size = bucket(num_live, len(done))
        if keep_size < len(done):
            rows = _rows_to_keep(done, keep_size)
            state.keep(rows)
            step.keep(rows)
            row_completion = [row_completion[r] for r in rows]
        window = min(every, steps_left)
        assert window > 0, "a live row outlived its length limit"
        for _ in range(window):
            state.record_live()
            step(state)
        steps_left -= window
        steps_run += window
    outputs = state.outputs if return_hidden else dataclasses.replace(state.outputs, hidden_NTH=None)
    rollout = collect_rollout(prompts, num_samples, outputs, stats, start, state.route_log)
    step.finish(rollout)
    return rollout


def first_draw(model: nn.Module, prompts: list[torch.Tensor], num_samples: int, sampling: SamplingConfig,
               generator: torch.Generator | None, keep_hidden: bool, limits: list[int],
               extra_slots: int, static_slots: bool = False, slot_block: int | None = None,
               recorder: RouteRecorder | None = None,
               prefix_routes: Sequence[torch.Tensor | None] | None = None) -> DecodeState:
    """Allocate the rollout's buffers once, prefill every prompt once, draw and emit each sample's first token
    (with ``recorder``, the prompts' routes kept and a ``RouteLog`` started for the completions'; the prefill
    replays ``prefix_routes``, ``generate``'s)."""
    device = prompts[0].device
    num_completions, max_new = len(prompts) * num_samples, sampling.max_new_tokens
    # Every emitted token but the last is fed back, so max_new - 1 slots would do; max_new keeps
    # the capacity >= 1 when max_new_tokens = 1. A tree step writes up to extra_slots more.
    cache = GroupedKVCache([len(p) for p in prompts], num_samples, capacity=max_new + extra_slots, device=device,
                           static_slots=static_slots, slot_block=slot_block)
    with maybe_replaying(model, prefill_replay(prefix_routes, [len(p) for p in prompts], device)):
        prompt_hidden_GPH = prefill_all_positions(model, cache, prompts)
    route_log = None if recorder is None else RouteLog(recorder, model, [len(p) for p in prompts], num_completions,
                                                       max_new + extra_slots + 1, device)
    last_GH = prompt_hidden_GPH[torch.arange(len(prompts), device=device),
                                torch.tensor([len(p) for p in prompts], device=device) - 1]
    lm_head = logits_head(model)
    # Columns: max_new, plus the most tokens a step emits (extra_slots + 1), written as leftovers.
    outputs = OutputBuffers.allocate(num_completions, max_new + extra_slots + 1, device,
                                     last_GH if keep_hidden else None, at_least_float32(last_GH[:0]).dtype)
    live = LiveRows.start(torch.tensor(limits, dtype=torch.long, device=device))
    state = DecodeState(model, lm_head, sampling, generator, StopCriteria(sampling, device), cache, outputs, live,
                        next_B=torch.zeros(num_completions, dtype=torch.long, device=device), prompts=prompts,
                        num_samples=num_samples, prompt_hidden_GPH=prompt_hidden_GPH,
                        live_counts_S=torch.zeros(max_new, dtype=torch.long, device=device),
                        step_index=torch.zeros(1, dtype=torch.long, device=device),
                        uniform_N=torch.zeros(num_completions, dtype=torch.float32, device=device),
                        route_log=route_log)
    # One row per sample, so that every sample draws its own first token from its prompt's logits.
    hidden_BH = last_GH.repeat_interleave(num_samples, dim=0)
    state.refill_uniforms()
    tokens_B, logprobs_B = state.draw(at_least_float32(lm_head(last_GH)).repeat_interleave(num_samples, dim=0))
    emit(outputs, live, tokens_B[:, None], logprobs_B[:, None], hidden_BH[:, None], torch.ones_like(tokens_B),
         state.criteria)
    state.next_B.copy_(tokens_B)
    return state


def prefill_replay(prefix_routes: Sequence[torch.Tensor | None] | None, prompt_lengths: Sequence[int],
                   device: torch.device) -> torch.Tensor | None:
    """The routes the prefill of the prompts right-padded ``[G, P]`` replays, ``[G * P, L, k]`` (-1 where none:
    the router's choice), from ``generate``'s ``prefix_routes``; None without any."""
    if prefix_routes is None or all(r is None for r in prefix_routes):
        return None
    if len(prefix_routes) != len(prompt_lengths):
        raise ValueError(f"prefix_routes has {len(prefix_routes)} entries; it needs one per prompt "
                         f"({len(prompt_lengths)})")
    like = next(r for r in prefix_routes if r is not None)
    routes = [like[:0] if r is None else r for r in prefix_routes]
    if any(r.shape[0] > length for r, length in zip(routes, prompt_lengths)):
        raise ValueError("prefix_routes: a prompt's routes are longer than the prompt")
    return padded_routes(routes, max(prompt_lengths)).to(device)


def _host_check(state: DecodeState, step: DecodeStep, stats: RolloutStats, first: int, window: int) -> list[bool]:
    """Host sync, once per window of steps: finished rows, the live counts of the window's steps
    (``first`` .. ``first + window - 1``), the non-finite flag and the step's own values, in one
    transfer. Returns which rows of the batch are done."""
    parts = [state.live.done_B.float(), state.outputs.nonfinite.float().view(1),
             state.live_counts_S[first:first + window].float()]
    values = step.host_values()
    if values is not None:
        parts.append(values.float())
    host = torch.cat(parts).tolist()  # host sync: the one per window
    num_rows = state.live.done_B.shape[0]
    if host[num_rows]:
        raise ValueError("the model's logits are not finite (NaN or inf) for some sequence: check the model's "
                         "weights (a diverged update, a bad checkpoint or a dtype overflow)")
    live_counts = [int(n) for n in host[num_rows + 1:num_rows + 1 + window]]
    stats.live_batch_sizes.extend(n for n in live_counts if n)
    stats.num_forwards += sum(1 for n in live_counts if n)
    stats.num_idle_steps += sum(1 for n in live_counts if not n)
    step.after_host_check(state, host[num_rows + 1 + window:])
    return [v > 0 for v in host[:num_rows]]


def _rows_to_keep(done: list[bool], keep_size: int) -> list[int]:
    """The live rows, padded with the first finished rows up to ``keep_size`` (increasing)."""
    live = [row for row, finished in enumerate(done) if not finished]
    padding = [row for row, finished in enumerate(done) if finished][:keep_size - len(live)]
    return sorted(live + padding)


_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _check_positions(model: nn.Module, prompts: list[torch.Tensor], new_tokens: list[int], limit_name: str) -> None:
    """Each prompt and its ``new_tokens`` fit the model's positions (``limit_name``: where that number comes from)."""
    max_positions = getattr(model.config, "max_position_embeddings", None)
    for index, (prompt, new) in enumerate(zip(prompts, new_tokens)):
        if max_positions is not None and prompt.numel() + new > max_positions:
            raise ValueError(
                f"prompts[{index}] has {prompt.numel()} tokens; with {limit_name}={new} it needs "
                f"{prompt.numel() + new} positions, more than the model's max_position_embeddings={max_positions}")


def _check_inputs(model: nn.Module, prompts: list[torch.Tensor], num_samples: int,
                  sampling: SamplingConfig, check_positions: bool = True) -> None:
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    check_materialized(model)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of 1-D token id tensors")
    vocab_size = embedding_table(model).num_embeddings
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, torch.Tensor):
            raise ValueError(f"prompts[{index}] must be a 1-D tensor of token ids, got {type(prompt).__name__}")
        if prompt.dim() != 1 or prompt.dtype not in _TOKEN_DTYPES:
            raise ValueError(f"prompts[{index}] must be a 1-D integer tensor of token ids, got {prompt.dtype} "
                             f"of shape {tuple(prompt.shape)}")
        if prompt.numel() == 0:
            raise ValueError(f"prompts[{index}] is empty; every prompt needs at least one token")
    if check_positions:
        _check_positions(model, prompts, [sampling.max_new_tokens] * len(prompts), "sampling.max_new_tokens")
    all_ids = torch.cat([p.reshape(-1).long() for p in prompts])
    low, high = torch.aminmax(all_ids)
    if int(low) < 0 or int(high) >= vocab_size:  # host sync: input validation, once per rollout
        raise ValueError(f"prompts hold token ids in [{int(low)}, {int(high)}]; allowed is [0, {vocab_size})")
    bad_stops = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise ValueError(f"sampling.stop_token_ids {bad_stops} are outside the vocabulary [0, {vocab_size})")
    check_logits_head(model)
