"""The asynchronous loop's rollout worker (train.max_staleness = k > 0): another process, on the same machine or
on another, that draws the rollouts of steps t+1..t+k while the trainer updates step t.

    trainer (loop.py)                                     worker (``_worker_main``)
    begin: publish version t, ask for steps t..t+k  ──►   builds its own policy copy from model.path, the
                                                          [env] factory, its draft head and the engine; per
    step t: take(t) ◄── rollout of step t ───────────     request: wait for version max(0, t-k), copy it in,
            score, prepare, update, draft lesson          draw with the request's seed, mark every token with
            publish(t+1), ask for step t+k+1  ──►         that version (Groups.at_version)

A version is the trainable parameters after that many steps: the policy's and, with speculation, the draft's
(``versioned_parameters``).

How the two talk is a transport (train.rollout_worker, ``TRANSPORTS``): "local" spawns the worker on this machine
and hands weights over through shared memory (``local.py``, ``weight_ring.py``); "remote" waits for a
worker the user starts on another machine (``turbogrpo rollout-worker``, ``serve`` here) and talks to it over
torch.distributed (``remote.py``, ``wire.py``). Either way only the trainable parameters travel, and
under torchrun each rank has its own worker, drawing its own share of prompts.

Exactness. A step's rollout depends only on (its prompts, its seed, the version it samples with), never on
timing: the worker waits for exactly that version. So the k > 0 loop is reproducible, and a resumed run
repeats an uninterrupted one by redrawing its in-flight rollouts by seed: the checkpoint at step t keeps the
versions they sample with (max(0, t-k)..t-1, safetensors, ``RolloutWorker.state_dict``), the resumed worker
draws them again. Failure. The worker exits when the trainer is gone, and sends any exception back as text; a
worker that dies is one ``RolloutWorkerError`` line on the trainer, not a hang.

Partial rollouts (train.partial_rollouts = c > 0, ``partial_rollouts.py``): the worker keeps a pool of groups whose
generations continue from step to step, draws k - c steps ahead, and sends each step's batch with its examples and
the pool after it; a checkpoint keeps that pool (it cannot be redrawn by seed without replaying the run).
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Callable

import torch
from torch import nn

from turbogrpo.data import PromptBatches, PromptExample
from turbogrpo.engines import draw
from turbogrpo.hook import lm_head_of
from turbogrpo.placement import DistInfo, resolve_device
from turbogrpo.rollout import Rollout
from turbogrpo.train.draft_learning import FORGET, build_online_draft
from turbogrpo.train.worker.partial_rollouts import PartialRollouts, pool_state, restore_pool
from turbogrpo.train.worker.remote import RemoteLink, RemoteTransport, connect, rank_port
from turbogrpo.train.worker.rollout_checks import RolloutMismatch, check_rollout
from turbogrpo.train.worker.weight_ring import frozen_digest, sampling_version, trainable_parameters
from turbogrpo.train.worker.local import SharedMemoryTransport, TransportOptions
from turbogrpo.train.worker.protocol import (TRAINER_CHOSEN, Drawn, Ready, Request, RolloutDrawn, RolloutWorkerError,
                                         WorkerFailed, WorkerSpec)

__all__ = ["TRANSPORTS", "RolloutWorker", "RolloutWorkerError", "WorkerSpec", "serve"]


TRANSPORTS: dict[str, Callable] = {"local": SharedMemoryTransport, "remote": RemoteTransport}
"""train.rollout_worker's values: each starts the trainer's side of its transport from ``(spec, dist, trainable
parameters, TransportOptions)`` (``local.py`` says what a transport does)."""


def _worker_main(spec: WorkerSpec, dist: DistInfo, link) -> None:
    """The worker: build the sampler, then draw each request until told to stop (None); ``link`` is the worker's
    side of the transport (``local.py``)."""
    link.open()
    try:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        sampler = _WorkerSampler(spec, dist)
        link.check_base(frozen_digest(sampler.policy), spec.model.path)
        link.put(Ready())
        while (request := link.next_request()) is not None:
            sampler.load(link, request.version)
            link.put(RolloutDrawn(request.step, sampler.draw(request)))
    except SystemExit:
        pass
    except KeyboardInterrupt:  # (a remote worker's Ctrl-C or SIGTERM; a local one ignores Ctrl-C)
        link.put(WorkerFailed("interrupted (Ctrl-C or SIGTERM on its machine)"))
    except (ValueError, RolloutWorkerError) as err:  # what the run's settings or its trainer got wrong: one line
        link.failure = str(err).splitlines()[0]
        link.put(WorkerFailed(link.failure))
    except BaseException as err:  # noqa: BLE001: every failure goes back to the trainer, named
        traceback.print_exc()  # the whole story on the worker's stderr; the trainer raises its one line
        link.failure = f"{type(err).__name__}: {err}".splitlines()[0]
        link.put(WorkerFailed(link.failure))
    finally:
        link.close()


def serve(spec: WorkerSpec, trainer: str, rank: int, connect_timeout_s: float, secret_file: str = "") -> int:
    """``turbogrpo rollout-worker``: connect to trainer rank ``rank`` at ``trainer`` ("HOST:PORT", PORT its
    train.rollout_port), draw its rollouts until it stops (0) or is gone (1)."""
    host, port = trainer_address(trainer, rank)
    dist = DistInfo(rank, 1, 0, resolve_device(spec.model.device))
    print(f"turbogrpo: rollout worker of rank {rank}: connecting to the trainer at {host}:{port + rank} "
          f"(up to {connect_timeout_s:g} s, train.rollout_connect_timeout_s)", file=sys.stderr, flush=True)
    pair, theirs = connect(host, port, rank, spec.sampling_settings(), connect_timeout_s, secret_file)
    spec = dataclasses.replace(spec, **{name: theirs[name] for name in TRAINER_CHOSEN})
    print(f"turbogrpo: rollout worker of rank {rank}: connected; drawing on {dist.device}", file=sys.stderr,
          flush=True)
    link = RemoteLink(pair, spec.max_staleness + 1, theirs.get("base"))
    _worker_main(spec, dist, link)
    why = f"failed: {link.failure}" if link.failure else link.ending or "failed"
    print(f"turbogrpo: rollout worker of rank {rank}: {why}; it stops", file=sys.stderr, flush=True)
    return 0 if link.ending == "stopped" and not link.failure else 1


def trainer_address(trainer: str, rank: int) -> tuple[str, int]:
    """``--trainer HOST:PORT`` as (host, port), or a ValueError saying what is wrong (``[::1]:PORT`` for IPv6)."""
    host, _, port = trainer.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit():
        raise ValueError(f"--trainer {trainer!r}: expected HOST:PORT, PORT the trainer's train.rollout_port")
    if rank < 0:
        raise ValueError(f"--rank {rank}: expected the trainer rank this worker serves (0, 1, ...)")
    rank_port(int(port), rank, "--trainer PORT")
    return host, int(port)


class _WorkerSampler:
    """The worker's own policy copy, draft head (rollout.speculation: its weights come with each version; the
    trainer teaches it), environment sampler and engine (rollout.engine: a vLLM one is built here, at the first
    rollout)."""

    def __init__(self, spec: WorkerSpec, dist: DistInfo):
        from turbogrpo.rollout.decode import run_schedule
        from turbogrpo.engines import build_engine, resolve_choice
        from turbogrpo.train.episodes import build_episode_sampler
        from turbogrpo.train.run import build_policy
        self.spec, self.device = spec, dist.device
        parts = build_policy(spec.model, spec.lora, spec.rollout, dist, seed=spec.seed)
        self.precision, self.policy, self.tokenizer, self.sampling = parts
        # A draft that does not learn here: the trainer teaches it, and each version brings its weights.
        self.draft = build_online_draft(spec.rollout.speculation, dataclasses.replace(spec.draft, learn=False),
                                        self.policy, spec.draft_context)
        # Built like the trainer's policy (and draft), so the same parameters are versioned, under the same names.
        self.parameters = versioned_parameters(self.policy, self.draft.draft if self.draft is not None else None)
        self.version: int | None = None
        self.episodes = build_episode_sampler(spec.env, self.tokenizer, spec.rollout.branching)
        choice = resolve_choice(spec.rollout.engine, dist.device, conversations=self.episodes is not None,
                                needs=spec.engine_needs, model_type=self.policy.config.model_type)
        schedule = run_schedule(dist.device, linears=spec.model.linear_kernel,
                                runner=choice.runner_for(spec.rollout.step_runner, lora=spec.lora.enabled))
        self.engine = build_engine(choice.engine, dist.device, schedule=schedule,
                                   dtype=self.precision.compute_dtype, tokenizer=self.tokenizer,
                                   max_length=spec.engine_max_length or None,
                                   enforce_eager=spec.rollout.vllm_enforce_eager,
                                   record_routes=spec.routing_replay == "replay")
        self.partial = (PartialRollouts(spec.rollout.num_generations, spec.rollout.max_new_tokens,
                                        spec.partial_rollouts) if spec.partial_rollouts else None)

    def load(self, link, version: int) -> None:
        """Weights ``version`` from the transport into the policy (and into an engine holding its own copy)."""
        if version == self.version:
            return
        link.load(version, self.parameters)
        if self.engine.holds_weights:
            self.engine.push_weights(self.policy)
        if self.draft is not None and self.spec.draft.learn and self.version is not None:
            self.draft.sizing.forget(FORGET)  # a new version's draft learned since: as the on-policy loop forgets
        self.version = version

    def draw(self, request: Request) -> Drawn:
        """The request's rollout, every token marked with the version that drew it (optimizer steps)."""
        if self.partial is not None:
            return self.draw_partial(request)
        with torch.no_grad(), self.precision.autocast():
            self.policy.eval()
            rollout, episodes = draw(self.engine, self.policy, self.tokenizer, self.episodes, request.examples,
                                     [p.to(self.device) for p in request.prompts], num_samples=self.spec.rollout.num_generations,
                                     sampling=self.sampling, seed=request.seed,
                                     draft=self.draft.speculation() if self.draft is not None else None)
        groups = rollout.groups.at_version(request.version * self.spec.num_iterations)
        if episodes is not None:  # the episodes' groups are the rollout's
            # Rewards read each episode's environment and what happened; the turn machinery (tools, renderer,
            # parser, decoder: closures over this process's tokenizer) stays here.
            transported = [dataclasses.replace(e, tools={}, renderer=None, parser=None, decode=None)
                           for e in episodes.episodes]
            episodes = dataclasses.replace(episodes, episodes=transported, rollout=dataclasses.replace(
                episodes.rollout, groups=groups, handlers=transported))
        return Drawn(Rollout(groups, rollout.stats), episodes)

    def draw_partial(self, request: Request) -> Drawn:
        """The request's segment of partial rollouts: its batch (carried groups among them), with the pool after it."""
        if request.carried is not None:
            self.partial.load_state_dict(request.carried)
        with torch.no_grad(), self.precision.autocast():
            self.policy.eval()
            rollout, examples = self.partial.segment(self.engine, self.policy, self.sampling, index=request.step,
                                                     examples=request.examples, num_groups=request.num_groups,
                                                     seed=request.seed,
                                                     version=request.version * self.spec.num_iterations,
                                                     draft=self.draft.speculation() if self.draft is not None else None)
        return Drawn(rollout, None, examples, list(self.partial.pool))


def versioned_parameters(policy: nn.Module, draft: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """What each version hands the worker: the policy's trainable parameters and, with speculation, the draft
    head's own (``draft/<name>``: the draft shares the policy's embeddings and LM head, which are the policy's)."""
    parameters = trainable_parameters(policy)
    if draft is not None:
        parameters.update({f"draft/{name}": p for name, p in draft.named_parameters()})
    return parameters


def output_vocab_size(policy: nn.Module) -> int:
    """The ids ``policy`` can sample: its LM head's rows (under a LoRA wrapper, the base layer's)."""
    head = lm_head_of(policy)
    weight = getattr(getattr(head, "base_layer", head), "weight", None)
    return weight.shape[0] if weight is not None else policy.config.vocab_size


class RolloutWorker:
    """The trainer's side: the worker's transport (``TRANSPORTS``) and the prompts asked for ahead."""

    def __init__(self, spec: WorkerSpec, dist: DistInfo, policy: nn.Module, *, num_steps: int,
                 prompts_per_step_slice: slice, seed_of, transport: str = "local",
                 options: TransportOptions | None = None, draft: nn.Module | None = None):
        """Start the worker (a local one builds its model while the trainer starts; a remote one is waited for
        as ``options`` say: where, how long, the secret). ``prompts_per_step_slice``: this rank's share of
        a step's prompts; ``seed_of(step)``: the step's sampling seed on this rank; ``draft``: the draft head the
        trainer teaches (its weights travel with each version)."""
        self.spec, self.dist, self.num_steps = spec, dist, num_steps
        self.local, self.seed_of = prompts_per_step_slice, seed_of
        self.parameters = versioned_parameters(policy, draft)
        options = dataclasses.replace(options or TransportOptions(None), worker_main=_worker_main)
        if transport == "remote":  # the weights a remote worker loads itself must be the trainer's
            options = dataclasses.replace(options, base={"digest": frozen_digest(policy), "path": spec.model.path})
        self.vocab_size = output_vocab_size(policy)
        self.asked_for: dict[int, Request] = {}
        """The requests whose rollouts have not arrived, by step (each rollout is checked against its own)."""
        self.transport = TRANSPORTS[transport](spec, dist, self.parameters, options)
        self.lookahead: PromptBatches | None = None
        self.asked = 0
        """Steps asked for so far (requests 0..asked-1 sent)."""
        self.restored: dict = {}
        self.carried: list | None = None
        """With partial rollouts: the pool after the last step taken (a checkpoint's), or a resumed run's."""
        self.resumed_at: int | None = None
        """With partial rollouts: the step a resumed run starts at (its request carries the restored pool)."""
        self.rows: dict[int, PromptExample] = {}
        """This run's prompts by row index (``begin``), which replace the worker's copies in what it sends back."""

    # --- checkpoints -------------------------------------------------------------------------------

    def in_flight_versions(self, step: int) -> list[int]:
        """The versions that the rollouts of steps step..step+a-1 sample with (a = ``steps_ahead``: k, or k - c
        with partial rollouts), older than ``step``'s own."""
        ahead = self.spec.steps_ahead
        return sorted({sampling_version(s, ahead) for s in range(step, step + ahead)} - {step})

    def state_dict(self, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        """A checkpoint at ``step`` (steps done): the weights its in-flight rollouts sample with (the policy's
        own, version ``step``, is the checkpoint's model) and, with partial rollouts, the generations carried
        into step ``step`` (``partial_rollouts.pool_state``)."""
        versions = self.in_flight_versions(step)
        tensors, scalars = self.transport.ring.state(versions), {"rollout_versions": versions}
        if self.spec.partial_rollouts:
            carried, scalars["carried"] = pool_state(self.carried or [])
            tensors.update(carried)
        return tensors, scalars

    def load_state_dict(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """A checkpoint's in-flight weights, written into the ring by ``begin`` (and its carried generations)."""
        self.restored = {"tensors": tensors, "versions": scalars.get("rollout_versions", []),
                         "carried": scalars.get("carried")}

    # --- the loop's side ---------------------------------------------------------------------------

    def begin(self, step: int, batches: PromptBatches) -> None:
        """Publish the policy as version ``step`` (with a resumed run's older versions) and ask for the rollouts
        of steps step..step+k, their prompts drawn from a copy of ``batches`` (the run's own stays at ``step``
        for checkpoints)."""
        if step and self.in_flight_versions(step) != self.restored.get("versions", []):
            raise RolloutWorkerError(f"the checkpoint at step {step} lacks the weights of its in-flight rollouts "
                                     f"(versions {self.in_flight_versions(step)}); it was not written by a run with "
                                     f"train.max_staleness = {self.spec.max_staleness}: resume with that run's setting")
        if step and self.spec.partial_rollouts and self.restored.get("carried") is None:
            raise RolloutWorkerError(f"the checkpoint at step {step} lacks the generations carried into it; it was not "
                                     f"written by a run with train.partial_rollouts = {self.spec.partial_rollouts}: "
                                     "resume with that run's setting")
        if self.restored:
            self.transport.restore(self.restored["tensors"], self.restored["versions"])
        self.resumed_at = step if step and self.spec.partial_rollouts else None
        if self.resumed_at is not None:
            self.carried = restore_pool(self.restored["tensors"], self.restored["carried"], batches.examples)
        self.transport.publish(step, self.parameters)
        self.rows = {example.index: example for example in batches.examples}
        self.lookahead = PromptBatches(batches.examples, batches.batch_size, seed=batches.seed, shuffle=batches.shuffle)
        self.lookahead.load_state_dict(batches.state_dict())
        if step and self.spec.partial_rollouts:
            next(self.lookahead)  # step ``step``'s prompts were started by the step before it (they are carried)
        self.asked = step
        self._ask_up_to(step + self.spec.steps_ahead)

    def publish(self, version: int) -> None:
        """After step ``version - 1``'s update: the new weights to the worker, and the next step asked for."""
        self.transport.publish(version, self.parameters)
        self._ask_up_to(version + self.spec.steps_ahead)

    def take(self, step: int) -> Drawn:
        """Step ``step``'s rollout and episodes (waits for it; the worker's failure raises). Its prompts are the
        step's own (``batches`` and its copy give the same ones), or with partial rollouts ``Drawn.examples``."""
        message = self._receive(step)
        if isinstance(message, Ready):  # the first message: the worker has built its model
            message = self._receive(step)
        request = self.asked_for.pop(step, None)
        try:
            if not isinstance(message, RolloutDrawn) or message.step != step or request is None:
                raise RolloutMismatch(f"it sent a {message.kind} message for step {getattr(message, 'step', None)} "
                                      f"where step {step}'s rollout was due")
            payload = message.drawn
            check_rollout(request, payload, num_generations=self.spec.rollout.num_generations,
                          vocab_size=self.vocab_size, rows=self.rows)
        except RolloutMismatch as err:
            raise RolloutWorkerError(f"the rollout worker ({self.transport.name}) sent a rollout that is not step "
                                     f"{step + 1}'s: {err}; the run stops") from None
        payload = self._own_rows(payload)
        if self.spec.partial_rollouts:
            self.carried = payload.carried
        return payload

    def close(self) -> None:
        """End the worker: no local process outlives the run, a remote one is told to stop."""
        self.transport.close()

    # --- pieces ------------------------------------------------------------------------------------

    def _ask_up_to(self, last: int) -> None:
        while self.asked <= min(last, self.num_steps - 1):
            step = self.asked
            examples, extra = self._starts(step)
            prompts = [e.token_ids for e in examples]
            version = sampling_version(step, self.spec.steps_ahead)
            request = Request(step, self.seed_of(step), version, prompts, examples, **extra)
            self.asked_for[step] = request
            self.transport.ask(request)
            self.asked += 1

    def _starts(self, step: int) -> tuple[list[PromptExample], dict]:
        """The prompts step ``step``'s rollout starts: the step's own; with partial rollouts those of the next step
        (and at step 0 both), none at the last step (``partial_rollouts.py``), the pool restored at a resume."""
        if not self.spec.partial_rollouts:
            return next(self.lookahead)[self.local], {}
        starts = next(self.lookahead)[self.local] if step == 0 else []
        if step + 1 < self.num_steps:
            starts = starts + next(self.lookahead)[self.local]
        num_groups = len(range(*self.local.indices(self.lookahead.batch_size)))
        carried = self.carried if step == self.resumed_at else None
        return starts, {"num_groups": num_groups, "carried": carried}

    def _own_rows(self, drawn: Drawn) -> Drawn:
        """``drawn`` with this run's own prompt rows in place of the worker's copies (pickled, or JSON from a remote
        worker, where a tuple in a column comes back a list): the rewards read the rows the data gave."""
        own = lambda example: self.rows[example.index]  # noqa: E731
        if drawn.examples is not None:
            drawn.examples = [own(example) for example in drawn.examples]
        for group in drawn.carried or ():
            group.example = own(group.example)
        return drawn

    def _receive(self, step: int) -> Ready | RolloutDrawn:
        message = self.transport.receive(step)
        if isinstance(message, WorkerFailed):
            raise RolloutWorkerError(f"the rollout worker ({self.transport.name}) failed before step {step + 1}'s "
                                     f"rollout: {message.error.strip().splitlines()[0]}")
        return message
