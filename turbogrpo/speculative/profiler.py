"""Forward latency vs. number of tokens on this device, its knee ``C_peak``, and a cache file for both.

A forward over n tokens costs about the same for every n up to a knee: below it the forward is
bound by reading the weights, above it by arithmetic. Speculation spends the flat part: with B live
sequences there are about ``C_peak / B`` tokens per sequence to verify for free. The knee depends on
the model, device, dtype and (through attention) the context length, so it is measured, not set:
``cached_profile`` returns the stored curve for this key or measures it (a few seconds) and stores
it in ``<cache>/latency_profiles.json``, the cache being turbogrpo's one cache folder
(``turbogrpo.cache.cache_root``: ``$TURBOGRPO_CACHE``, else ``~/.cache/turbogrpo``). A damaged file
(not JSON, not an object, an entry of the wrong shape) is named, its bad entries measured again and
the file rewritten; a cache that cannot be written only costs measuring again next time.

The verify curve times the engine's own plain step (``turbogrpo.rollout.step.PlainStep``) with n
live sequences, as a rollout runs it: the forward of one new token each over the shared context, the
LM head, the draw and the emission. A tree of N nodes per sequence costs the linear layers what
N x n sequences cost. The draft curve times the
draft layer plus LM head and top-k over n tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from turbogrpo.cache import CACHE_ENV, cache_root
from turbogrpo.files import describe_os_error, write_text_atomically
from turbogrpo.hook import embedding_table
from turbogrpo.linears import LINEAR_KERNELS, onednn_min_rows
from turbogrpo.rollout.decode import first_draw
from turbogrpo.rollout.sampling import SamplingConfig
from turbogrpo.rollout.step import PlainStep
from turbogrpo.speculative.draft_decoding import DraftKVCache, TreeDrafter, draft_prompt_lengths, prefill_draft
from turbogrpo.speculative.tree import DraftLevel, top_proposals

LEGACY_CACHE_ENV = "TURBOGRPO_CACHE_DIR"  # this file's own variable before TURBOGRPO_CACHE; still honoured
CACHE_FILE = "latency_profiles.json"
PROFILE_VERSION = 8  # bump when what is timed changes, so stale entries are not reused


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds per forward at measured token counts (increasing)."""

    num_tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: float) -> float:
        """Latency at ``n`` tokens: linear between measured points, extended by the last slope."""
        xs, ys = self.num_tokens, self.seconds
        if n <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        return ys[-1] + self.final_slope * (n - xs[-1])

    def at(self, n: torch.Tensor) -> torch.Tensor:
        """Vectorised ``__call__`` for a float tensor of token counts (host tensors)."""
        xs = torch.tensor(self.num_tokens, dtype=torch.float64)
        ys = torch.tensor(self.seconds, dtype=torch.float64)
        n = n.double()
        index = torch.searchsorted(xs, n.clamp(max=xs[-1])).clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
        inside = y0 + (y1 - y0) * (n.clamp(min=xs[0]) - x0) / (x1 - x0)
        return torch.where(n > xs[-1], ys[-1] + self.final_slope * (n - xs[-1]), inside)

    @property
    def final_slope(self) -> float:
        """Seconds per extra token past the knee (the last segment's slope, at least 0)."""
        if len(self.num_tokens) < 2:
            return 0.0
        dx = self.num_tokens[-1] - self.num_tokens[-2]
        return max(0.0, (self.seconds[-1] - self.seconds[-2]) / dx)

    def knee(self) -> int:
        """``C_peak``: the token count at which a forward costs twice the one-token forward. Below it
        extra tokens ride along nearly free (the forward is bound by weight reads and per-call
        overhead); above it every token costs its own arithmetic. Interpolated between measured
        points; the largest measured count if the curve never doubles."""
        target = 2 * self.seconds[0]
        points = list(zip(self.num_tokens, self.seconds))
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if y1 >= target:
                return int(x0 + (x1 - x0) * (target - y0) / (y1 - y0)) if y1 > y0 else x0
        return self.num_tokens[-1]


@dataclass(frozen=True)
class LatencyProfile:
    """Latency curves of one (model, draft, device, dtype, context length)."""

    key: str
    verify: LatencyCurve
    draft: LatencyCurve | None

    @property
    def c_peak(self) -> int:
        return self.verify.knee()

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> LatencyProfile:
        """The profile ``to_json`` wrote; ValueError/KeyError/TypeError for anything of another shape."""
        if not isinstance(data, dict) or not isinstance(data["key"], str):
            raise TypeError("a profile is an object with a string key")
        draft = data.get("draft")
        return LatencyProfile(key=data["key"], verify=_curve_from_json(data["verify"]),
                              draft=None if draft is None else _curve_from_json(draft))


def _curve_from_json(data: dict) -> LatencyCurve:
    """A stored curve, checked: at least one point, increasing positive token counts, finite seconds >= 0."""
    num_tokens, seconds = tuple(data["num_tokens"]), tuple(data["seconds"])
    if not num_tokens or len(num_tokens) != len(seconds):
        raise ValueError("a curve needs as many seconds as token counts, at least one")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in num_tokens) or \
            any(b <= a for a, b in zip(num_tokens, num_tokens[1:])):
        raise ValueError("token counts must be increasing integers >= 1")
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 for t in seconds):
        raise ValueError("seconds must be finite numbers >= 0")
    return LatencyCurve(num_tokens, tuple(float(t) for t in seconds))


def profile_key(model: nn.Module, *, context_length: int, draft: nn.Module | None = None) -> str:
    """Model (architecture and sizes), draft depth, device, dtype and context length (rounded up to a
    power of two, so that nearby lengths share a profile)."""
    parameter = next(model.parameters())
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation", "architectures"):
        config.pop(volatile, None)
    config_hash = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    draft_part = "none" if draft is None else f"{draft.config.num_layers}layer" + (
        f"-{draft.config.num_draft_tokens}tokens" if draft.config.num_draft_tokens else "")
    context = 1 << max(0, int(context_length) - 1).bit_length()
    dtype = str(parameter.dtype).removeprefix("torch.")
    return (f"v{PROFILE_VERSION}|{model.config.model_type}-{config_hash}|draft-{draft_part}"
            f"|{device_name(parameter.device)}|{dtype}|ctx{context}|linears-{default_linear_kernel(parameter)}")


def default_linear_kernel(parameter: torch.Tensor) -> str:
    """The kernel a rollout's "auto" linears run with these weights (``turbogrpo.linears``): the profile
    is timed under it, and it moves the curve (on an AMD EPYC, oneDNN's 32-row step is a third of MKL's)."""
    min_rows = onednn_min_rows(parameter.dtype, torch.get_num_threads()) if parameter.device.type == "cpu" else None
    return "module" if min_rows is None else "onednn" if min_rows == 1 else f"onednn-from{min_rows}rows"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    # Idle OpenMP threads that sleep (OMP_WAIT_POLICY=PASSIVE) must be woken for every parallel op,
    # which adds a fixed cost to each small GEMM and moves the knee: profiles are kept apart.
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "default").lower()
    return (f"{device.type}:{platform.processor() or platform.machine()}:{torch.get_num_threads()}threads"
            f":omp-{wait_policy}")


def cache_path() -> Path:
    """``<cache>/latency_profiles.json`` (``$TURBOGRPO_CACHE_DIR`` still names the folder where set)."""
    legacy = os.environ.get(LEGACY_CACHE_ENV)
    return (Path(legacy).expanduser() if legacy else cache_root()) / CACHE_FILE


def cached_profile(model: nn.Module, *, context_length: int, draft: nn.Module | None = None,
                   path: str | Path | None = None, refresh: bool = False, **profile_options) -> LatencyProfile:
    """The stored profile for this key, or a fresh measurement (stored for next time)."""
    path = Path(path) if path is not None else cache_path()
    key = profile_key(model, context_length=context_length, draft=draft)
    stored = _read(path)
    if not refresh and key in stored:
        return stored[key]
    profile = profile_latency(model, context_length=context_length, draft=draft, **profile_options)
    stored = _read(path, quiet=True)  # re-read: another process may have added entries meanwhile
    stored[key] = profile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Concurrent readers never see half a file.
        write_text_atomically(path, json.dumps({k: v.to_json() for k, v in stored.items()}, indent=1))
    except OSError as err:  # a read-only cache: the profile is used, only not kept
        warnings.warn(f"could not store the latency profile in {path} ({describe_os_error(err)}); it is "
                      f"measured again next time (set {CACHE_ENV} to a writable folder)", UserWarning, stacklevel=2)
    return profile


def _read(path: Path, *, quiet: bool = False) -> dict[str, LatencyProfile]:
    """The profiles stored in ``path`` by key ({} when there is no file); a file or entry that is damaged
    is named in a warning and left out, so it is measured again and rewritten."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as err:
        if not quiet:
            warnings.warn(f"latency profile file {path} is not readable ({describe_os_error(err)}); measuring "
                          "anew", UserWarning, stacklevel=3)
        return {}
    try:
        data = json.loads(text)
    except ValueError as err:
        data = err
    if not isinstance(data, dict):
        if not quiet:
            found = f"not JSON ({data})" if isinstance(data, ValueError) else f"a JSON {type(data).__name__}"
            warnings.warn(f"latency profile file {path} is damaged ({found}, not an object of profiles); its "
                          "profiles are measured again and the file rewritten", UserWarning, stacklevel=3)
        return {}
    profiles, damaged = {}, []
    for key, entry in data.items():
        try:
            profiles[key] = LatencyProfile.from_json(entry)
        except (KeyError, TypeError, ValueError):
            damaged.append(key)
    if damaged and not quiet:
        warnings.warn(f"latency profile file {path}: {len(damaged)} damaged entr{'y' if len(damaged) == 1 else 'ies'} "
                      f"({damaged[0]!r}{', ...' if len(damaged) > 1 else ''}) measured again and rewritten",
                      UserWarning, stacklevel=3)
    return profiles


@torch.no_grad()
def profile_latency(model: nn.Module, *, context_length: int, draft: nn.Module | None = None,
                    max_tokens: int = 512, repeats: int = 5, seed: int = 0) -> LatencyProfile:
    """Measure the verify (and draft) latency curves at token counts 1, 2, 4, ... ``max_tokens``.

    n tokens are timed as n sequences of one new token each, sharing one prompt of
    ``context_length`` tokens: the shape of a decoding step (a tree adds a few tokens per sequence,
    which costs the linear layers the same rows). Counts are visited from the largest down, so one
    prefill serves them all (the cache drops rows as n shrinks).
    """
    check_profile_size(model, context_length=context_length, max_tokens=max_tokens, repeats=repeats)
    device = next(model.parameters()).device
    vocab_size = embedding_table(model).num_embeddings
    generator = torch.Generator(device=device).manual_seed(seed)
    grid = _grid(max_tokens)
    prompt = torch.randint(vocab_size, (context_length,), device=device, generator=generator)
    # The engine's own state and step (the plain step, as a rollout runs it: forward, LM head, draw,
    # emit): one prompt shared by grid[-1] rows, cut to n rows per point. Every timed step commits
    # one token, so the capacity covers all of them.
    num_steps = len(grid) * (repeats + 1) + 1
    state = first_draw(model, [prompt], grid[-1], SamplingConfig(max_new_tokens=num_steps + 1), generator,
                       False, [num_steps + 1] * grid[-1], 0)
    prompt_hidden = state.prompt_hidden_GPH
    step = PlainStep()

    def verify(n: int) -> Callable[[], object]:
        state.keep(list(range(n)))
        return lambda: step(state)

    draft_cache = None
    if draft is not None:
        draft_cache = DraftKVCache(draft_prompt_lengths(draft, [prompt]), grid[-1], capacity=1, device=device)
        # An "eagle3" draft reads wider policy features; timing only, so the final ones repeated do.
        prefill_draft(draft, draft_cache, [prompt], prompt_hidden.repeat(1, 1, draft.feature_width // prompt_hidden.shape[-1]))

    def draft_level(n: int) -> Callable[[], object]:
        draft_cache.keep(list(range(n)))
        level = DraftLevel(torch.randint(vocab_size, (n, 1), device=device, generator=generator),
                           torch.zeros(n, 1, dtype=torch.long, device=device),
                           torch.ones(n, 1, 1, dtype=torch.bool, device=device), 1)
        features = prompt_hidden[:, -1].expand(n, -1)
        # One tree level as decoding runs it: the plan, the draft layer, LM head, log-softmax, top-k.
        return lambda: top_proposals(TreeDrafter(draft, draft_cache, features)(level), min(8, vocab_size))

    with LINEAR_KERNELS["auto"]([model] + ([draft] if draft is not None else [])):  # timed as a rollout runs
        verify_curve = _measure(verify, grid, repeats, device)
        draft_curve = None if draft is None else _measure(draft_level, grid, repeats, device)
    return LatencyProfile(profile_key(model, context_length=context_length, draft=draft), verify_curve, draft_curve)


def _grid(max_tokens: int) -> list[int]:
    """The measured token counts: the powers of two up to ``max_tokens``."""
    return [1 << i for i in range(max(1, int(max_tokens)).bit_length()) if 1 << i <= max_tokens]


def check_profile_size(model: nn.Module, *, context_length: int, max_tokens: int, repeats: int = 5,
                       keys: tuple[str, str] = ("context_length", "max_tokens")) -> None:
    """ValueError in one line, naming ``keys`` (the caller's names for the two sizes), when a profile
    cannot run: a size below 1, a context (plus the tokens the timed steps add) past the model's
    positions, or more memory than this device has free (estimated from the model's shapes)."""
    context_key, tokens_key = keys
    for key, value in ((context_key, context_length), (tokens_key, max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    num_steps = len(_grid(max_tokens)) * (repeats + 1) + 2  # as profile_latency commits them
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and context_length + num_steps > positions:
        raise ValueError(f"{context_key} = {context_length} is past this model's positions: it attends over at most "
                         f"{positions}, and profiling adds {num_steps} tokens; use at most {positions - num_steps}")
    needed, free = profile_memory_bytes(model, context_length, max_tokens, num_steps), free_memory_bytes(model)
    if free is not None and needed > free:
        fits = max((n for n in _grid(max_tokens) if profile_memory_bytes(model, context_length, n, num_steps) <= free),
                   default=None)
        raise ValueError(f"{tokens_key} = {max_tokens} with {context_key} = {context_length} needs about "
                         f"{needed / 2**30:.1f} GiB on {next(model.parameters()).device}, which has {free / 2**30:.1f} "
                         "GiB free; " + (f"use {tokens_key} {fits} or less" if fits else f"lower {context_key}"))


def profile_memory_bytes(model: nn.Module, context_length: int, max_tokens: int, num_steps: int) -> int:
    """An upper estimate of what ``profile_latency`` allocates besides the weights: the KV cache (one shared
    prompt, ``num_steps`` generated slots for each of the largest count's rows), each step's float32 logits
    and probabilities and MLP activations, and the prefill's attention scores (materialised by the CPU's
    SDPA)."""
    config, rows = model.config, _grid(max_tokens)[-1]
    element = next(model.parameters()).element_size()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_per_token = 2 * config.num_hidden_layers * getattr(config, "num_key_value_heads", heads) * head_dim * element
    kv = (context_length + rows * (num_steps + 1)) * kv_per_token
    per_row_step = (3 * 4 * config.vocab_size + 4 * element * getattr(config, "intermediate_size", 4 * config.hidden_size)
                    + 4 * heads * (context_length + num_steps))
    prefill_scores = 4 * heads * context_length * context_length
    return int(kv + rows * per_row_step + prefill_scores)


def free_memory_bytes(model: nn.Module) -> int | None:
    """Memory free for new tensors on the model's device: the GPU's free memory, or the host's available
    memory (``MemAvailable``); None where it cannot be read."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _measure(make: Callable[[int], Callable[[], object]], grid: list[int], repeats: int,
             device: torch.device) -> LatencyCurve:
    seconds = []
    for n in reversed(grid):
        run = make(n)
        run()  # warm-up (allocations, kernel selection)
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            times.append(time.perf_counter() - start)
        # The fastest run: on a shared machine other jobs only ever add time, so the minimum is the
        # best estimate of what the device itself takes.
        seconds.append(min(times))
    seconds.reverse()
    # Timing noise can make a larger forward look faster; latency never truly drops with more tokens.
    monotone = [max(seconds[: i + 1]) for i in range(len(seconds))]
    return LatencyCurve(tuple(grid), tuple(monotone))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so wall-clock timings include it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceStopwatch:
    """Accumulated device time of blocks of work, without a host sync per block.

    ``with stopwatch: ...`` brackets work with CUDA events (on the CPU, where ops run as they are
    called, with the wall clock); ``seconds`` reads the events' elapsed times, which waits for them,
    so read it once the caller has synced anyway (the end of a rollout). ``timed(work)`` syncs
    around ``work`` and returns its wall seconds (counted too): for one-off work whose time the
    caller needs at once.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._host_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: float | torch.cuda.Event | None = None

    def __enter__(self) -> DeviceStopwatch:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._host_seconds += time.perf_counter() - self._start

    def timed(self, work: Callable[[], object]) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        work()
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self._host_seconds += seconds
        return seconds

    @property
    def seconds(self) -> float:
        # Host sync (CUDA): waits for the recorded events; read once, at the end of a rollout.
        return self._host_seconds + sum(start.elapsed_time(end) for start, end in self._events) / 1000
