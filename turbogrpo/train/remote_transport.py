"""train.rollout_worker = "remote": the rollout worker on another machine, over torch.distributed.

    trainer rank r (listens)                                  worker (``turbogrpo rollout-worker CONFIG
    TCPStore on train.rollout_port + r                        --trainer HOST:PORT --rank r``, connects)
    "spec": the sampling settings (JSON)  ──────────────►     compares them with its own config's
                                          ◄──────────────     "hello": its host and pid, or why it refuses
    two 2-process gloo groups over PrefixStores of that store: "to_worker" (weights, requests, stop) and
    "to_trainer" (ready, rollouts, errors); each carries ``wire.py`` messages (JSON + flat tensors, no pickles)

The groups are built as vLLM's stateless process groups are (a ``ProcessGroup`` with its gloo backend registered,
over a ``PrefixStore``), so they never touch torch.distributed's global state: under torchrun the trainer's default
group stays the trainer ranks' alone, and rank r pairs with the worker started with ``--rank r``. One group per
direction, so that each is used by one thread on each side: the worker receives weights and requests on a thread
while its main thread draws and its outbox sends rollouts; the trainer sends from its loop and receives in ``take``.
Every wait goes through ``wire.finish`` (gloo's wait on a helper thread, the caller on an event), so Ctrl-C and
SIGTERM stop a side whose peer hangs.

Weights. Each side keeps a ``WeightRing`` of k + 1 versions in its own memory. After each update the trainer
writes version v into its ring (the versions a checkpoint keeps) and sends it, the trainable parameters as one
flat buffer; the worker's receiving thread writes it into the worker's ring, and a request for version v waits for
it and copies it in (``WeightRing.load_into``), as the local worker does. The ring's lock-free argument holds
unchanged: version v + 1 is sent after step v's rollout has arrived, so the worker finished copying from the slot
it overwrites. Resume sends the checkpoint's in-flight versions before the current one.

Failure. A side whose peer is gone gets an error from gloo (the connection closes when a process dies): the
trainer raises one ``RolloutWorkerError`` line, the worker stops. NCCL for the weights (both sides on CUDA) is not
built: they travel through host memory over gloo (on another machine, set GLOO_SOCKET_IFNAME to the interface the
machines reach each other on, as torch.distributed asks).
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroup, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from turbogrpo.train import wire
from turbogrpo.train.distributed import DistInfo
from turbogrpo.train.weight_ring import WeightRing
from turbogrpo.train.wire import Message
from turbogrpo.train.worker_transport import Outbox
from turbogrpo.train.worker_types import POLL_S, TRAINER_CHOSEN, Request, RolloutWorkerError, WorkerSpec

TRAINER, WORKER = 0, 1
"""Ranks in the pair's groups."""

IDLE_LIMIT = timedelta(days=7)
"""The groups' timeout: how long a side may wait for the other's next message (an update or a rollout may take
hours); a peer that dies is seen at once (its connection closes), not after this."""

SPEC_KEYS = {"seed": "train.seed", "max_staleness": "train.max_staleness", "num_iterations": "algo.num_iterations",
             "partial_rollouts": "train.partial_rollouts"}
"""The config keys of ``WorkerSpec``'s fields that are not a section."""


@dataclass
class Pair:
    """The trainer and its worker: the store, one group per direction, and who the other side is."""

    store: TCPStore
    to_worker: ProcessGroup
    to_trainer: ProcessGroup
    peer: str
    """The other side, for messages: "host, pid N"."""


def pair_group(store, name: str, rank: int) -> ProcessGroup:
    """A 2-process gloo group under ``name`` in ``store`` (not registered with torch.distributed)."""
    prefix = PrefixStore(name, store)
    group = ProcessGroup(prefix, rank, 2)
    backend = ProcessGroupGloo(prefix, rank, 2, IDLE_LIMIT)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


def _keys(store, rank: int):
    return PrefixStore(f"turbogrpo/rollout/rank{rank}", store)


def _groups(store, keys, rank: int, peer: str) -> Pair:
    return Pair(store, pair_group(keys, "to_worker", rank), pair_group(keys, "to_trainer", rank), peer)


def listen(port: int, rank: int, settings: dict, timeout_s: float) -> Pair:
    """The trainer's side: listen on ``port + rank``, wait for the worker (``timeout_s``), refuse one whose
    sampling settings differ, build the groups."""
    try:
        store = TCPStore("127.0.0.1", port + rank, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:  # (DistNetworkError: the port is taken)
        raise RolloutWorkerError(f"rank {rank} cannot listen for its rollout worker on port {port + rank} "
                                 f"(train.rollout_port + rank): {_first_line(err)}") from None
    keys = _keys(store, rank)
    keys.set("spec", json.dumps(settings))
    print(f"turbogrpo: rank {rank} waits up to {timeout_s:g} s (train.rollout_connect_timeout_s) for its rollout "
          f"worker on port {port + rank}: start it on its machine with `turbogrpo rollout-worker CONFIG --trainer "
          f"{socket.gethostname()}:{port} --rank {rank}`", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    while not keys.check(["hello"]):
        if time.monotonic() > deadline:
            raise RolloutWorkerError(f"no rollout worker connected to rank {rank} (port {port + rank}) within "
                                     f"{timeout_s:g} s (train.rollout_connect_timeout_s): start `turbogrpo "
                                     f"rollout-worker CONFIG --trainer HOST:{port} --rank {rank}` on its machine")
        time.sleep(0.2)
    hello = json.loads(keys.get("hello"))
    peer = f"{hello['host']}, pid {hello['pid']}"
    if "error" in hello:
        raise RolloutWorkerError(f"the rollout worker ({peer}) refused this run: {hello['error']}")
    return _groups(store, keys, TRAINER, peer)


def connect(host: str, port: int, rank: int, settings: dict, timeout_s: float) -> tuple[Pair, dict]:
    """The worker's side: connect to trainer rank ``rank`` at ``host:port + rank`` (waiting ``timeout_s`` for it),
    check that both sample alike, build the groups; returns them and the trainer's settings (``TRAINER_CHOSEN``
    are the worker's to take). A refusal is a ValueError (and the trainer is told)."""
    try:
        store = TCPStore(host, port + rank, is_master=False, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise RolloutWorkerError(f"no trainer listening at {host}:{port + rank} (rank {rank}) within {timeout_s:g} s "
                                 f"(train.rollout_connect_timeout_s): {_first_line(err)}") from None
    keys = _keys(store, rank)
    hello = {"host": socket.gethostname(), "pid": os.getpid()}
    theirs = json.loads(keys.get("spec"))
    difference = first_difference({k: v for k, v in theirs.items() if k not in TRAINER_CHOSEN},
                                  {k: v for k, v in json.loads(json.dumps(settings)).items() if k not in TRAINER_CHOSEN})
    if difference:
        keys.set("hello", json.dumps({**hello, "error": difference}))
        raise ValueError(f"{difference}; start the rollout worker with the run's config")
    keys.set("hello", json.dumps(hello))
    return _groups(store, keys, WORKER, f"the trainer at {host}:{port + rank}"), theirs


def first_difference(theirs: dict, ours: dict, path: str = "") -> str:
    """The first sampling setting in which the trainer's (``theirs``) and this worker's differ, as a config key and
    both values ("" for none)."""
    for name in sorted(theirs.keys() | ours.keys()):
        there, here = theirs.get(name), ours.get(name)
        key = f"{path}.{name}" if path else SPEC_KEYS.get(name, name)
        if isinstance(there, dict) and isinstance(here, dict):
            if found := first_difference(there, here, key):
                return found
        elif there != here:
            return f"config key {key!r} is {there!r} in the trainer's run and {here!r} here"
    return ""


def _first_line(err: BaseException) -> str:
    """What went wrong, short: gloo's "[pair.cc:537] Read error [host]:port: Connection reset by peer. This is
    typically ..." becomes "Read error [host]:port: Connection reset by peer"."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]


# --- the trainer's side --------------------------------------------------------------------------------------


class DistributedTransport:
    """The trainer's side of a remote worker (``worker_transport.py`` says what each method does)."""

    def __init__(self, spec: WorkerSpec, dist: DistInfo, parameters: dict[str, torch.Tensor], port: int,
                 connect_timeout_s: float):
        self.ring = WeightRing(parameters, spec.max_staleness + 1)  # what a checkpoint keeps, and resends
        self.device = dist.device
        self.pair = listen(port, dist.rank, spec.sampling_settings(), connect_timeout_s)
        self.name = f"rank {dist.rank}'s, {self.pair.peer}"
        self.with_rows = spec.reads_rows
        """Whether requests carry the prompts' rows (``WorkerSpec.reads_rows``)."""
        self.sending = ""
        """What the trainer is sending ("" between sends; left set by a send that an interrupt cut short)."""

    def publish(self, version: int, parameters: dict[str, torch.Tensor]) -> None:
        self.ring.publish(version, parameters)
        self._send_version(version)

    def restore(self, tensors: dict[str, torch.Tensor], versions: list[int]) -> None:
        self.ring.restore(tensors, versions)
        for version in versions:
            self._send_version(version)

    def ask(self, request: Request) -> None:
        self._send(wire.request_message(request, self.with_rows), f"step {request.step + 1}'s request")

    def receive(self, step: int) -> tuple:
        try:
            message = wire.receive(self.pair.to_trainer, WORKER, self.device)
        except RuntimeError as err:
            raise self._gone(f"before step {step + 1}'s rollout", err) from None
        if message.kind == "rollout":
            return "rollout", message.header["step"], wire.drawn_of(message)
        return message.kind, message.header.get("step"), message.header.get("error")

    def close(self) -> None:
        """Tell the worker to stop, then let the groups go (their connections close: a worker still sending a
        rollout nobody takes stops too)."""
        if self.pair is None:
            return
        # Not after a send that Ctrl-C or SIGTERM cut short: its frame is half sent, and the worker could not read
        # what followed (it sees the connection close when this process ends). Within POLL_S: a hung worker takes
        # nothing, and the run is ending.
        if not self.sending:
            try:
                self._send(Message({"kind": "stop"}), "the stop", timeout_s=POLL_S)
            except (RolloutWorkerError, TimeoutError):
                pass  # gone already, or hung
        self.pair = None

    def _send_version(self, version: int) -> None:
        slot = self.ring.slots[version % len(self.ring.slots)]
        self._send(Message({"kind": "weights", "version": version}, dict(slot)), f"weights version {version}")

    def _send(self, message: Message, what: str, timeout_s: float | None = None) -> None:
        self.sending = what
        try:
            wire.send(self.pair.to_worker, WORKER, wire.encode(message), timeout_s)
        except RuntimeError as err:
            raise self._gone(f"while the trainer sent {what}", err) from None
        self.sending = ""

    def _gone(self, when: str, err: BaseException) -> RolloutWorkerError:
        return RolloutWorkerError(f"the rollout worker ({self.name}) is gone {when} ({_first_line(err)}); "
                                  "the run stops")


# --- the worker's side ---------------------------------------------------------------------------------------


class DistributedLink:
    """The worker's side of a remote transport: a thread receives weights (into the worker's own ring) and
    requests; an outbox sends the worker's messages."""

    def __init__(self, pair: Pair, num_slots: int):
        self.pair, self.num_slots = pair, num_slots
        self.ring: WeightRing | None = None
        """Made from the first weights that arrive (their names, shapes and dtypes)."""
        self.requests: queue.Queue = queue.Queue()
        self.ending = ""
        """Why the trainer's messages ended: "stopped" (told to), else the trainer is gone."""

    def open(self) -> None:
        self.receiver = threading.Thread(target=self._receive, name="turbogrpo-weights", daemon=True)
        self.receiver.start()
        self.outbox = Outbox(self._encode, lambda frame: wire.send(self.pair.to_trainer, TRAINER, frame))

    def alive(self) -> None:
        if not self.receiver.is_alive():
            raise SystemExit(0)  # the trainer is gone or said stop: nothing more to draw for

    def next_request(self) -> Request | None:
        request = self.requests.get()
        return None if self.ending else request  # told to stop, or the trainer is gone: nobody wants the rest

    def load(self, version: int, parameters: dict[str, torch.Tensor]) -> None:
        while self.ring is None:
            self.alive()
            time.sleep(0.01)
        self.ring.load_into(version, parameters, alive=self.alive)

    def put(self, message: tuple) -> None:
        self.outbox.put(message)

    def close(self) -> None:
        self.outbox.close(timeout_s=POLL_S)  # a trainer that is gone takes nothing more

    def _receive(self) -> None:
        try:
            while (message := wire.receive(self.pair.to_worker, TRAINER, torch.device("cpu"))).kind != "stop":
                if message.kind == "weights":
                    if self.ring is None:
                        self.ring = WeightRing(message.tensors, self.num_slots)
                    self.ring.publish(message.header["version"], message.tensors)
                else:
                    self.requests.put(wire.request_of(message))
            self.ending = "stopped"
        except (RuntimeError, OSError, ValueError) as err:
            self.ending = f"the trainer is gone ({_first_line(err)})"
        finally:
            self.requests.put(None)

    @staticmethod
    def _encode(message: tuple) -> wire.Frame:
        kind, step, payload = message
        if kind == "rollout":
            return wire.encode(wire.drawn_message(step, payload))
        return wire.encode(Message({"kind": kind, "step": step, "error": payload}))
