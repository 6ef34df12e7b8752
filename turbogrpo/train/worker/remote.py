"""train.rollout_worker = "remote": the rollout worker on another machine, over one authenticated, encrypted TCP
connection per trainer rank (``secure_channel.py``).

    trainer rank r (listens on train.rollout_host,            worker (``turbogrpo rollout-worker CONFIG
    port train.rollout_port + r)                              --trainer HOST:PORT --rank r``, connects)
    handshake: both prove they hold the run's secret  ◄──────►  (the secret never travels)
    "spec": the sampling settings, the base weights' digest ──►  compares them with its own config's
                                                      ◄──────  "hello": its host and pid, or why it refuses
    then ``wire.py`` messages both ways (JSON + flat tensors, no pickles): weights, requests and "stop" to the
    worker; "ready" (its model built, its base weights checked), rollouts and errors to the trainer

Who gets in. The trainer binds the address train.rollout_host names (loopback by default; another address needs a
secret given to both machines, ``secure_channel.rollout_secret``). A connection that does not prove the secret is
refused and logged in one line; the first that does becomes the rank's worker, and every later one is told that
the rank has its worker (one line on both sides) while the first keeps the run. Everything after the handshake is
encrypted and authenticated, so nobody else reads the weights or writes a message. The trainer still checks what
its worker sends against what it asked (``rollout_checks.py``), and a LoRA run's worker, which receives only the
adapters, must hold base weights of the trainer's digest (``weight_ring.frozen_digest``).

Weights. Each side keeps a ``WeightRing`` of k + 1 versions in its own memory. After each update the trainer
writes version v into its ring (the versions a checkpoint keeps) and sends it, the trainable parameters as one
flat buffer; the worker's receiving thread writes it into the worker's ring, and a request for version v waits for
it and copies it in (``WeightRing.load_into``), as the local worker does. The ring's lock-free argument holds
unchanged: version v + 1 is sent after step v's rollout has arrived, so the worker finished copying from the slot
it overwrites. Resume sends the checkpoint's in-flight versions before the current one.

Threads. The socket is full duplex: the trainer sends from its loop and receives in ``take``; the worker receives
weights and requests on a thread while its main thread draws and its outbox sends rollouts. Blocking socket calls
return to Python on a signal, so Ctrl-C and SIGTERM stop a side whose peer hangs.

Failure. A side whose peer is gone sees its connection close: the trainer raises one ``RolloutWorkerError`` line,
the worker stops with one line. A message that fails authentication or is malformed is one line naming the peer
and what was wrong. NCCL for the weights (both sides on CUDA) is not built: they travel through host memory.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch

from turbogrpo.placement import DistInfo
from turbogrpo.train.worker import wire
from turbogrpo.train.worker.secure_channel import (HANDSHAKE_S, Channel, ChannelError, prove_as_trainer, prove_as_worker,
                                            rollout_secret)
from turbogrpo.train.worker.weight_ring import WeightRing
from turbogrpo.train.worker.wire import BadMessage, Message
from turbogrpo.train.worker.local import Outbox, TransportOptions
from turbogrpo.train.worker.protocol import (POLL_S, TRAINER_CHOSEN, Ready, Request, RolloutDrawn, RolloutWorkerError,
                                         WorkerFailed, WorkerMessage, WorkerSpec)

SPEC_KEYS = {"seed": "train.seed", "max_staleness": "train.max_staleness", "num_iterations": "algo.num_iterations",
             "partial_rollouts": "train.partial_rollouts", "routing_replay": "algo.routing_replay"}
"""The config keys of ``WorkerSpec``'s fields that are not a section."""

MAX_PORT = 65535


def rank_port(port: int, rank: int, key: str = "train.rollout_port") -> int:
    """The port of trainer rank ``rank`` (``port + rank``), or a ValueError naming ``key`` where it is no TCP port."""
    if not 1 <= port + rank <= MAX_PORT or rank < 0:
        raise ValueError(f"{key} + rank = {port} + {rank} is not a TCP port (1..{MAX_PORT}); choose a port with room "
                         "for every trainer rank")
    return port + rank


def _log(text: str) -> None:
    print(f"turbogrpo: {text}", file=sys.stderr, flush=True)


# --- the trainer's side --------------------------------------------------------------------------------------


class Listener:
    """Trainer rank ``rank``'s port: each connection is handshaken on a thread of its own (one that says nothing
    delays nobody); the first that proves the secret and accepts the run's settings is the rank's worker
    (``wait_for_worker``), every later one is refused."""

    def __init__(self, host: str, port: int, rank: int, secret: bytes, spec: dict):
        self.rank, self.secret, self.spec, self.port = rank, secret, spec, port
        self.worker: str | None = None
        """The worker's name once one is paired ("host, pid N")."""
        self.claim = threading.Lock()
        self.paired: queue.Queue = queue.Queue()
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(8)
        except OSError as err:
            raise RolloutWorkerError(f"rank {rank} cannot listen for its rollout worker on {host}:{port} "
                                     f"(train.rollout_host, train.rollout_port + rank): {err.strerror or err}") from None
        self.thread = threading.Thread(target=self._accept, name="turbogrpo-listener", daemon=True)
        self.thread.start()

    def wait_for_worker(self, timeout_s: float) -> tuple[Channel, str]:
        """The paired worker's channel and name (waits ``timeout_s``; a worker that refuses the run raises)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                channel, peer, refusal = self.paired.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise RolloutWorkerError(
                        f"no rollout worker connected to rank {self.rank} (port {self.port}) within {timeout_s:g} s "
                        f"(train.rollout_connect_timeout_s): start `turbogrpo rollout-worker CONFIG --trainer "
                        f"HOST:{self.port - self.rank} --rank {self.rank}` on its machine") from None
                continue
            if refusal:
                raise RolloutWorkerError(f"the rollout worker ({peer}) refused this run: {refusal}")
            return channel, peer

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, address = self.sock.accept()
            except OSError:
                return  # closed: the run is over
            threading.Thread(target=self._admit, args=(connection, address), daemon=True).start()

    def _admit(self, connection: socket.socket, address) -> None:
        where = f"{address[0]}:{address[1]}"
        try:
            channel = prove_as_trainer(connection, self.secret)
        except (ChannelError, OSError) as err:
            # Logged before the close, so the line is out before the peer sees the connection end.
            _log(f"rank {self.rank} refused a connection from {where}: {err}")
            connection.close()
            return
        with self.claim:
            first, self.worker = self.worker is None, self.worker or where
        if not first:
            self._refuse(channel, where)
            return
        try:
            channel.sock.settimeout(HANDSHAKE_S)
            wire.send(channel, wire.encode(Message(self.spec)))
            hello = wire.parsed(_hello_of, wire.receive(channel, torch.device("cpu")))
            channel.sock.settimeout(None)
        except (ChannelError, BadMessage, OSError) as err:
            with self.claim:
                self.worker = None  # not a worker after all: the next one may pair
            channel.close()
            _log(f"rank {self.rank} refused a connection from {where}: its hello was bad ({err})")
            return
        self.worker = hello["peer"]
        self.paired.put((channel, hello["peer"], hello["error"]))

    def _refuse(self, channel: Channel, where: str) -> None:
        why = (f"trainer rank {self.rank} already has its rollout worker ({self.worker}), which keeps the run; "
               "start one worker per trainer rank (--rank)")
        try:
            channel.sock.settimeout(HANDSHAKE_S)
            wire.send(channel, wire.encode(Message({"kind": "refused", "error": why})))
        except OSError:
            pass
        channel.close()
        _log(f"rank {self.rank} refused a second rollout worker from {where}: it has one ({self.worker})")


def _hello_of(message: Message) -> dict:
    """The worker's hello: who it is ("host, pid N") and its refusal ("" for none)."""
    header = message.header
    if message.kind != "hello":
        raise BadMessage(f"it sent a {message.kind!r} message where its hello was due")
    error = header.get("error", "")
    if not isinstance(error, str):
        raise BadMessage("its refusal has no text")
    return {"peer": f"{str(header['host'])[:100]}, pid {int(header['pid'])}", "error": error.splitlines()[0] if error
            else ""}


class RemoteTransport:
    """The trainer's side of a remote worker (``local.py`` says what each method does)."""

    def __init__(self, spec: WorkerSpec, dist: DistInfo, parameters: dict[str, torch.Tensor],
                 options: TransportOptions):
        self.ring = WeightRing(parameters, spec.max_staleness + 1)  # what a checkpoint keeps, and resends
        self.device, self.rank = dist.device, dist.rank
        port = rank_port(options.port, dist.rank)
        try:
            secret = rollout_secret(options.secret_file, options.host)
        except ValueError as err:
            raise RolloutWorkerError(str(err)) from None
        settings = {"kind": "spec", "settings": spec.sampling_settings(), "base": options.base}
        self.listener = Listener(options.host, port, dist.rank, secret, settings)
        shown = socket.gethostname() if options.host in ("0.0.0.0", "::") else options.host
        _log(f"rank {dist.rank} waits up to {options.connect_timeout_s:g} s (train.rollout_connect_timeout_s) for "
             f"its rollout worker on {options.host}:{port}: start it with `turbogrpo rollout-worker CONFIG "
             f"--trainer {shown}:{options.port} --rank {dist.rank}`")
        try:
            self.channel, peer = self.listener.wait_for_worker(options.connect_timeout_s)
        except BaseException:
            self.listener.close()
            raise
        self.name = f"rank {dist.rank}'s, {peer}"
        self.with_rows = spec.reads_rows
        """Whether requests carry the prompts' rows (``WorkerSpec.reads_rows``)."""
        self.sending = ""
        """What the trainer is sending ("" between sends; left set by a send that an interrupt cut short)."""
        self.broken = False
        """Whether a send found the worker gone (nothing more is sent; ``receive`` says why)."""

    def publish(self, version: int, parameters: dict[str, torch.Tensor]) -> None:
        self.ring.publish(version, parameters)
        self._send_version(version)

    def restore(self, tensors: dict[str, torch.Tensor], versions: list[int]) -> None:
        self.ring.restore(tensors, versions)
        for version in versions:
            self._send_version(version)

    def ask(self, request: Request) -> None:
        self._send(wire.request_message(request, self.with_rows), f"step {request.step + 1}'s request")

    def receive(self, step: int) -> WorkerMessage:
        try:
            message = wire.receive(self.channel, self.device)
            return _worker_message(message)
        except (ChannelError, BadMessage) as err:
            raise RolloutWorkerError(f"the rollout worker ({self.name}) sent a bad message before step {step + 1}'s "
                                     f"rollout: {err}; the run stops") from None
        except (ConnectionError, OSError) as err:
            raise self._gone(f"before step {step + 1}'s rollout", err) from None

    def close(self) -> None:
        """Tell the worker to stop, then close the connection (a worker still sending a rollout nobody takes stops
        too) and the port."""
        if self.channel is None:
            return
        # Not after a send that Ctrl-C or SIGTERM cut short: its frame is half sent, and the worker could not read
        # what followed (it sees the connection close when this process ends). Within POLL_S: a hung worker takes
        # nothing, and the run is ending.
        if not self.sending:
            try:
                self._send(Message({"kind": "stop"}), "the stop", timeout_s=POLL_S)
            except TimeoutError:
                pass  # hung
        self.channel.close()
        self.listener.close()
        self.channel = None

    def _send_version(self, version: int) -> None:
        slot = self.ring.slots[version % len(self.ring.slots)]
        self._send(Message({"kind": "weights", "version": version}, dict(slot)), f"weights version {version}")

    def _send(self, message: Message, what: str, timeout_s: float | None = None) -> None:
        """Send ``message``; a worker that is gone is left for ``receive`` to report: its last words (an error it
        sent before it went, such as a SIGTERM on its machine) are still to be read there, in order."""
        if self.broken:
            return
        self.sending = what
        try:
            wire.send(self.channel, wire.encode(message), timeout_s)
        except TimeoutError:
            raise
        except OSError:
            self.broken = True
        self.sending = ""

    def _gone(self, when: str, err: BaseException) -> RolloutWorkerError:
        return RolloutWorkerError(f"the rollout worker ({self.name}) is gone {when} ({_first_line(err)}); "
                                  "the run stops")


def _worker_message(message: Message) -> WorkerMessage:
    """A worker's message as its type; a kind a worker does not send, or a field of the wrong kind, is a
    BadMessage."""
    header = message.header
    step = header.get("step")
    if step is not None and not isinstance(step, int):
        raise BadMessage(f"its {message.kind!r} message names step {step!r}, not a number")
    if message.kind == RolloutDrawn.kind:
        return RolloutDrawn(step, wire.parsed(wire.drawn_of, message))
    if message.kind == WorkerFailed.kind:
        if not isinstance(header.get("error"), str) or not header["error"].strip():
            raise BadMessage("it sent an error without its text")
        return WorkerFailed(header["error"])
    if message.kind == Ready.kind:
        return Ready()
    raise BadMessage(f"it sent a message of kind {message.kind!r} (a worker sends ready, rollout or error)")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# --- the worker's side ---------------------------------------------------------------------------------------


@dataclass
class Pair:
    """A worker's connection to its trainer, and who the trainer is."""

    channel: Channel
    peer: str
    """The trainer, for messages: "the trainer at HOST:PORT"."""


def connect(host: str, port: int, rank: int, settings: dict, timeout_s: float, secret_file: str) -> tuple[Pair, dict]:
    """The worker's side: connect to trainer rank ``rank`` at ``host:port + rank`` (waiting ``timeout_s`` for it to
    listen), prove the secret, check that both sample alike; returns the pair and the trainer's spec (its settings:
    ``TRAINER_CHOSEN`` are the worker's to take; the base weights' digest). Different settings are a ValueError (and
    the trainer is told); a peer that is not this run's trainer, or refuses this worker, a RolloutWorkerError."""
    address = f"{host}:{rank_port(port, rank, '--trainer PORT')}"
    secret = rollout_secret(secret_file, host)
    channel = _handshaken(host, port + rank, address, timeout_s, secret)
    try:
        channel.sock.settimeout(HANDSHAKE_S)
        spec = wire.receive(channel, torch.device("cpu"))
        if spec.kind == "refused":
            raise RolloutWorkerError(f"the trainer at {address} refused this worker: "
                                     f"{str(spec.header.get('error', ''))[:300]}")
        if spec.kind != "spec" or not isinstance(spec.header.get("settings"), dict):
            raise BadMessage(f"it sent a {spec.kind!r} message where the run's settings were due")
        theirs = spec.header["settings"]
        hello = {"kind": "hello", "host": socket.gethostname(), "pid": os.getpid()}
        difference = first_difference({k: v for k, v in theirs.items() if k not in TRAINER_CHOSEN},
                                      {k: v for k, v in json.loads(json.dumps(settings)).items()
                                       if k not in TRAINER_CHOSEN})
        wire.send(channel, wire.encode(Message({**hello, "error": difference} if difference else hello)))
        channel.sock.settimeout(None)
    except (ChannelError, BadMessage) as err:
        channel.close()
        raise RolloutWorkerError(f"the trainer at {address} sent a bad message: {err}") from None
    except OSError as err:
        channel.close()
        raise RolloutWorkerError(f"the trainer at {address} closed the connection during the handshake "
                                 f"({_first_line(err)})") from None
    if difference:
        channel.close()
        raise ValueError(f"{difference}; start the rollout worker with the run's config")
    return Pair(channel, f"the trainer at {address}"), {**theirs, "base": spec.header.get("base")}


def _handshaken(host: str, port: int, address: str, timeout_s: float, secret: bytes) -> Channel:
    """A proven channel to the trainer at ``host:port``, retrying a refused connection until ``timeout_s`` (the
    trainer may start later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=min(HANDSHAKE_S, timeout_s))
            break
        except (ConnectionRefusedError, TimeoutError) as err:
            if time.monotonic() >= deadline:
                raise RolloutWorkerError(f"no trainer listening at {address} within {timeout_s:g} s "
                                         f"(train.rollout_connect_timeout_s): {_first_line(err)}") from None
            time.sleep(0.5)
        except OSError as err:
            raise RolloutWorkerError(f"cannot reach the trainer at {address}: {err.strerror or err}") from None
    try:
        return prove_as_worker(sock, secret)
    except ChannelError as err:
        sock.close()
        raise RolloutWorkerError(f"the peer at {address} is not this run's trainer: {err}") from None


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


class RemoteLink:
    """The worker's side of a remote transport: a thread receives weights (into the worker's own ring) and
    requests; an outbox sends the worker's messages."""

    def __init__(self, pair: Pair, num_slots: int, base: dict | None = None):
        self.pair, self.num_slots = pair, num_slots
        self.base = base
        """The trainer's base weights (``{"digest", "path"}``), which this worker's must equal."""
        self.ring: WeightRing | None = None
        """Made from the first weights that arrive (their names, shapes and dtypes)."""
        self.requests: queue.Queue = queue.Queue()
        self.ending = ""
        """Why the trainer's messages ended: "stopped" (told to), else what went wrong."""
        self.failure = ""
        """Why the worker failed, in one line ("" while it has not)."""

    def open(self) -> None:
        self.receiver = threading.Thread(target=self._receive, name="turbogrpo-weights", daemon=True)
        self.receiver.start()
        self.outbox = Outbox(self._encode, lambda frame: wire.send(self.pair.channel, frame))

    def check_base(self, digest: str, path: str) -> None:
        """Refuse base weights other than the trainer's (a LoRA run's worker loads them itself)."""
        if self.base and self.base.get("digest") != digest:
            raise ValueError(f"this worker's base weights (model.path {path!r}) differ from the trainer's "
                             f"(model.path {self.base.get('path')!r}): a LoRA run's adapters travel, its base "
                             "weights do not; point both at the same model")

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
        self.ring.check_fits(parameters)
        self.ring.load_into(version, parameters, alive=self.alive)

    def put(self, message: WorkerMessage) -> None:
        self.outbox.put(message)

    def close(self) -> None:
        self.outbox.close(timeout_s=POLL_S)  # a trainer that is gone takes nothing more
        self.pair.channel.close()

    def _receive(self) -> None:
        try:
            while (message := wire.receive(self.pair.channel, torch.device("cpu"))).kind != "stop":
                if message.kind == "weights":
                    version = message.header.get("version")
                    if not isinstance(version, int) or version < 0:
                        raise BadMessage(f"its weights name version {version!r}")
                    if self.ring is None:
                        self.ring = WeightRing(message.tensors, self.num_slots)
                    self.ring.publish(version, message.tensors)
                elif message.kind == "request":
                    self.requests.put(wire.parsed(wire.request_of, message))
                else:
                    raise BadMessage(f"it sent a message of kind {message.kind!r} (a trainer sends weights, "
                                     "request or stop)")
            self.ending = "stopped"
        except (ChannelError, BadMessage, KeyError) as err:
            self.ending = f"the trainer's message was bad ({_first_line(err)})"
        except (OSError, ValueError, RuntimeError) as err:
            self.ending = f"the trainer is gone ({_first_line(err)})"
        finally:
            self.requests.put(None)

    @staticmethod
    def _encode(message: WorkerMessage) -> wire.Frame:
        if isinstance(message, RolloutDrawn):
            return wire.encode(wire.drawn_message(message.step, message.drawn))
        return wire.encode(Message({"kind": message.kind, "error": getattr(message, "error", None)}))
