"""What the trainer and its rollout worker exchange (train.max_staleness = k > 0), whatever carries it
(``local.py``): the worker's spec, the requests, the rollouts drawn, and the one error type."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from turbogrpo.config import AlgoConfig, DraftLearningConfig, EnvConfig, LoraConfig, ModelConfig, RolloutConfig, TrainConfig
from turbogrpo.data import PromptExample
from turbogrpo.engines import run_needs
from turbogrpo.env import EnvRollout
from turbogrpo.rollout import Rollout

TRAINER_CHOSEN = ("draft_context", "engine_max_length")
"""``WorkerSpec`` fields the trainer derives from what only it has (the data): a remote worker takes the trainer's."""

POLL_S = 5.0
"""How often a waiting side checks that the other is still there (seconds)."""


class RolloutWorkerError(RuntimeError):
    """The rollout worker died, raised or never came; the message names it and its error."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker builds its sampler from: the run's sections that say how it samples."""

    model: ModelConfig
    lora: LoraConfig
    rollout: RolloutConfig
    env: EnvConfig
    seed: int
    """train.seed (LoRA's initial adapters: the same as the trainer's, before version 0 is copied in)."""
    num_threads: int
    """torch threads of the worker (train.rollout_threads, resolved; 0: torch's default)."""
    max_staleness: int
    num_iterations: int
    """algo.num_iterations: a version of GRPO steps is version x num_iterations in optimizer steps."""
    partial_rollouts: int = 0
    """train.partial_rollouts: c > 0 carries unfinished generations into the next step (``partial_rollouts.py``)."""
    draft: DraftLearningConfig = dataclasses.field(default_factory=DraftLearningConfig)
    """The [draft] section: with rollout.speculation on, the worker drafts with each version's draft head (the
    trainer teaches it; the weights travel with the policy's)."""
    draft_context: int = 0
    """The tokens a typical decoding step attends to, for the sizing's hardware profile: the trainer's (it has the
    data; a remote worker takes the trainer's, ``TRAINER_CHOSEN``)."""
    engine_max_length: int = 0
    """The longest prompt + completion the engine serves (0: the model's limit), as the trainer's engine is built:
    the trainer's (it has the data; ``TRAINER_CHOSEN``)."""
    routing_replay: str = "off"
    """algo.routing_replay: "replay" records each rollout's MoE routes (the trainer replays them)."""

    @classmethod
    def of(cls, model: ModelConfig, lora: LoraConfig, rollout: RolloutConfig, env: EnvConfig, train: TrainConfig,
           algo: AlgoConfig, draft: DraftLearningConfig, num_threads: int, draft_context: int = 0,
           engine_max_length: int = 0) -> WorkerSpec:
        """The spec of a run's sections, the worker taking ``num_threads`` torch threads."""
        return cls(model, lora, rollout, env, train.seed, num_threads, train.max_staleness, algo.num_iterations,
                   train.partial_rollouts, draft, draft_context, engine_max_length, algo.routing_replay)

    @property
    def drafts(self) -> bool:
        """Whether the worker samples speculatively (rollout.speculation on)."""
        return self.rollout.speculation != "off"

    @property
    def engine_needs(self) -> tuple[str, ...]:
        """What the worker's engine must be able to do (``engines.run_needs``; the trainer's config asks the same)."""
        return run_needs(speculation=self.drafts, conversations=bool(self.env.factory),
                         partial_rollouts=self.partial_rollouts > 0, asynchronous=True, sharded=False,
                         routing_replay=self.routing_replay != "off")

    @property
    def steps_ahead(self) -> int:
        """How many steps ahead the worker draws: k, less the steps a generation may be carried."""
        return self.max_staleness - self.partial_rollouts

    @property
    def reads_rows(self) -> bool:
        """Whether the worker reads the prompts' rows, not their ids alone: an [env] run's columns and chat messages
        (each conversation's environment is reset from its row), a partial-rollouts run's (its pool keeps them)."""
        return bool(self.env.factory) or self.partial_rollouts > 0

    def sampling_settings(self) -> dict:
        """The settings two sides must agree on to draw the same rollouts (JSON-able; not the machine's own:
        model.path and model.device may differ between machines, and so may the worker's threads)."""
        settings = dataclasses.asdict(self)
        del settings["model"]["path"], settings["model"]["device"], settings["num_threads"], settings["draft"]["path"]
        return settings


@dataclass(frozen=True)
class Request:
    """Draw step ``step``'s rollout with ``seed`` from weights ``version`` (GRPO steps done)."""

    step: int
    seed: int
    version: int
    prompts: list[torch.Tensor]
    examples: list[PromptExample]
    num_groups: int = 0
    """With partial rollouts: the groups the step trains (its ``examples`` are the groups it starts)."""
    carried: list | None = None
    """With partial rollouts, in a resumed run's first request: the checkpoint's pool (``PendingGroup``s)."""


@dataclass
class Drawn:
    """One step's rollout as the worker sends it."""

    rollout: Rollout
    episodes: EnvRollout | None = None
    examples: list[PromptExample] | None = None
    """With partial rollouts: the examples of the batch's groups (not the step's own prompts); else None."""
    carried: list | None = None
    """With partial rollouts: the pool after this step (``PendingGroup``s), what a checkpoint keeps."""


# --- what the worker tells the trainer (each transport carries these: pickled locally, ``wire.py`` remotely) ---


@dataclass(frozen=True)
class Ready:
    """The worker built its model (its first message)."""

    kind: ClassVar[str] = "ready"


@dataclass(frozen=True)
class RolloutDrawn:
    """Step ``step``'s rollout."""

    step: int
    drawn: Drawn
    kind: ClassVar[str] = "rollout"


@dataclass(frozen=True)
class WorkerFailed:
    """Why the worker stopped, in one line (it raised, was interrupted, or refused the run)."""

    error: str
    kind: ClassVar[str] = "error"


WorkerMessage = Ready | RolloutDrawn | WorkerFailed
"""Everything a worker sends its trainer."""


class AheadRollouts(Protocol):
    """What the loop and the checkpoints ask of the rollout worker (``rollout_worker.RolloutWorker`` is the one)."""

    def begin(self, step: int, batches) -> None:
        """Publish the weights of ``step`` and ask for the rollouts of the steps ahead (``batches``: the run's
        ``PromptBatches``, at ``step``)."""

    def take(self, step: int) -> Drawn:
        """Step ``step``'s rollout (waits for it)."""

    def publish(self, version: int) -> None:
        """The weights after step ``version - 1``'s update, and the next step asked for."""

    def state_dict(self, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        """What a checkpoint at ``step`` keeps of the rollouts in flight."""

    def load_state_dict(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """A checkpoint's rollouts in flight, resent by ``begin``."""

    def close(self) -> None:
        """End the worker."""
