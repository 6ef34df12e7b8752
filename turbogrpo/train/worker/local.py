"""How the trainer and its rollout worker talk (train.rollout_worker): one small unit per way, registered by name
(``rollout_worker.TRANSPORTS``).

    name      the worker                                         weights                      requests, rollouts
    "local"   a process the trainer spawns on its machine        shared memory (WeightRing)   a queue; a pipe (pickles
                                                                                              between two processes
                                                                                              of one run)
    "remote"  ``turbogrpo rollout-worker`` started by the user,  torch.distributed sends      torch.distributed sends:
              on another machine (``remote.py``)       (flat tensors)               JSON and tensors, no
                                                                                              pickles (``wire.py``)

A transport has two sides. The trainer's (``RolloutWorker`` holds it): ``publish(version, parameters)`` (the new
weights), ``restore(tensors, versions)`` (a checkpoint's in-flight versions), ``ask(request)``, ``receive(step)``
(the worker's next message: ``protocol.WorkerMessage``, a ``Ready``, ``RolloutDrawn`` or ``WorkerFailed``;
a worker that is gone raises ``RolloutWorkerError``), ``ring`` (the versions a checkpoint keeps: ``ring.state(versions)``) and ``close()``.
The worker's (``_worker_main`` runs on it): ``open()``, ``next_request()`` (None: stop), ``load(version,
parameters)`` (waits for the version), ``put(message)`` and ``close()``; a trainer that is gone ends the worker
(SystemExit).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from turbogrpo.placement import DistInfo
from turbogrpo.train.worker.weight_ring import WeightRing
from turbogrpo.train.worker.protocol import POLL_S, Request, RolloutWorkerError, WorkerSpec


@dataclass(frozen=True)
class TransportOptions:
    """What starting a transport needs besides the spec: the worker's main function (a local transport spawns it)
    and where a remote worker connects (train.rollout_host, port train.rollout_port + this rank, within
    train.rollout_connect_timeout_s), with the secret and the base weights it must prove."""

    worker_main: Callable
    port: int = 0
    connect_timeout_s: float = 0.0
    host: str = "127.0.0.1"
    """The address a remote transport listens on (train.rollout_host)."""
    secret_file: str = ""
    """train.rollout_secret_file (``secure_channel.rollout_secret``)."""
    base: dict | None = None
    """The policy's base weights as a remote worker must hold them: ``{"digest", "path"}``
    (``weight_ring.frozen_digest``, model.path)."""


def transport_options(train) -> TransportOptions:
    """The [train] section's transport settings (``TrainConfig``: rollout_host, rollout_port,
    rollout_connect_timeout_s, rollout_secret_file); the worker's main function is the caller's to set."""
    return TransportOptions(None, train.rollout_port, train.rollout_connect_timeout_s, train.rollout_host,
                            train.rollout_secret_file)


UNGUARDED_MAIN_EXIT = 3
"""The exit code of a worker process that found itself running the user's script again (``leave_if_importing_main``)."""

UNGUARDED_MAIN = ("the rollout worker process could not start: the script that called turbogrpo.train runs it when "
                  "imported, and the worker is started with multiprocessing's spawn, which imports the main script, "
                  "so it ran the training again; put the call under `if __name__ == \"__main__\":` (train.max_staleness "
                  "> 0 starts a worker process)")


def leave_if_importing_main() -> None:
    """In a process that multiprocessing's spawn is starting (it imports the parent's main script first), exit
    with ``UNGUARDED_MAIN_EXIT`` before anything is built: the script called ``train`` at import, without the
    ``__main__`` guard. The trainer names the missing guard when it sees that exit code (otherwise the child's
    second training tried to spawn a worker itself: two tracebacks, leaked semaphores, "out of memory?")."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(UNGUARDED_MAIN_EXIT)


class Outbox:
    """A side's messages to the other, encoded when put and sent in order by a thread, so that the sender goes on
    (the worker draws the next rollout while the trainer is still reading the last one). A failed send ends the
    thread (the other side is gone); ``failed`` says so."""

    def __init__(self, encode: Callable, send: Callable):
        self.encode, self.send = encode, send
        self.pending: queue.Queue = queue.Queue()
        self.failed = False
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def put(self, message) -> None:
        self.pending.put(self.encode(message))

    def _send(self) -> None:
        while (item := self.pending.get()) is not None:
            try:
                self.send(item)
            except (OSError, RuntimeError, ValueError):  # the other side is gone: nothing more can reach it
                self.failed = True
                return

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is queued (waiting at most ``timeout_s``)."""
        self.pending.put(None)
        self.thread.join(timeout_s)


# --- "local": a spawned process, shared memory -------------------------------------------------------------


class SharedMemoryLink:
    """The worker's side of a local transport (pickled into the spawned process)."""

    def __init__(self, ring: WeightRing | None, requests, connection, parent_pid: int):
        self.ring, self.requests, self.connection, self.parent_pid = ring, requests, connection, parent_pid
        self.outbox: Outbox | None = None
        self.failure = ""
        """Why the worker failed, in one line ("" while it has not)."""

    def open(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the trainer ends the worker
        # The trainer's terminate() (SIGTERM) becomes SystemExit, so the process's finalizers run: a semaphore made
        # here (tqdm's multiprocessing lock, made by the model's loading bar) is unlinked instead of leaking, which
        # made the resource tracker warn after every stopped run.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        self.outbox = Outbox(pickle.dumps, self.connection.send_bytes)

    def check_base(self, digest: str, path: str) -> None:
        """(The worker loads the trainer's own model.path on the same machine.)"""

    def alive(self) -> None:
        if os.getppid() != self.parent_pid:
            raise SystemExit(0)  # the trainer is gone (killed): nothing to draw for

    def next_request(self) -> Request | None:
        while True:
            try:
                request = self.requests.get(timeout=POLL_S)
            except queue.Empty:
                self.alive()
                continue
            return None if request is None else pickle.loads(request)  # (from the trainer process itself)

    def load(self, version: int, parameters: dict[str, torch.Tensor]) -> None:
        self.ring.load_into(version, parameters, alive=self.alive)

    def put(self, message) -> None:
        self.outbox.put(message)

    def close(self) -> None:
        """Send what is queued, then close the pipe."""
        self.outbox.close()
        self.connection.close()


class SharedMemoryTransport:
    """The trainer's side of a local transport: the worker process, its queue and pipe, the shared weight ring."""

    def __init__(self, spec: WorkerSpec, dist: DistInfo, parameters: dict[str, torch.Tensor],
                 options: TransportOptions):
        context = mp.get_context("spawn")
        self.ring = WeightRing(parameters, spec.max_staleness + 1, context)
        self.requests = context.Queue()
        self.results, writer = context.Pipe(duplex=False)
        link = SharedMemoryLink(self.ring, self.requests, writer, os.getpid())
        self.process = context.Process(target=options.worker_main, name=f"turbogrpo-rollout-rank{dist.rank}",
                                       daemon=True, args=(spec, dist, link))
        self.process.start()
        writer.close()  # the worker holds the only write end: its death ends the pipe

    def publish(self, version: int, parameters: dict[str, torch.Tensor]) -> None:
        self.ring.publish(version, parameters)

    def restore(self, tensors: dict[str, torch.Tensor], versions: list[int]) -> None:
        self.ring.restore(tensors, versions)

    def ask(self, request: Request) -> None:
        self.requests.put(pickle.dumps(request))

    def receive(self, step: int):
        while True:
            try:
                if not self.results.poll(POLL_S):
                    if self.process.is_alive():
                        continue
                    raise EOFError
                return pickle.loads(self.results.recv_bytes())  # (from the worker this process spawned)
            except (EOFError, OSError):
                self.process.join(timeout=POLL_S)
                if self.process.exitcode == UNGUARDED_MAIN_EXIT:
                    raise RolloutWorkerError(UNGUARDED_MAIN) from None
                raise RolloutWorkerError(f"the rollout worker ({self.process.name}, pid {self.process.pid}) died "
                                         f"with exit code {self.process.exitcode} before step {step + 1}'s "
                                         "rollout (out of memory? see the system log); the run stops") from None

    @property
    def name(self) -> str:
        return self.process.name

    def close(self) -> None:
        """End the worker (asked first, then terminated): no process outlives the run."""
        if self.process.is_alive():
            try:
                self.requests.put(None)
                self.process.join(timeout=10)
            except (OSError, ValueError):
                pass
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.requests.cancel_join_thread()  # a dead worker reads nothing: do not wait to flush it at exit
        self.requests.close()
        self.results.close()

