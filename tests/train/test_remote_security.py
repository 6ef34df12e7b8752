"""The remote rollout worker's port admits only its own peer (train.rollout_worker = "remote"): both sides prove the
run's secret before anything else, every later record is encrypted and authenticated, a second worker is refused
while the first keeps the run, and every bad frame, bad peer or bad address is one line naming what was wrong."""

import dataclasses
import http.server
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from turbogrpo.batch import Groups
from turbogrpo.config import ConfigError, load_config
from turbogrpo.data import PromptExample
from turbogrpo.placement import DistInfo
from turbogrpo.rollout import Rollout
from turbogrpo.rollout.types import RolloutStats
from turbogrpo.train.worker import secure_channel, wire
from turbogrpo.train.loop import train
from turbogrpo.train.worker.remote import RemoteLink, RemoteTransport, connect
from turbogrpo.train.worker.rollout_checks import RolloutMismatch, check_rollout
from turbogrpo.train.worker.rollout_worker import RolloutWorkerError, WorkerSpec
from turbogrpo.train.worker.secure_channel import (MAGIC, NONCE_BYTES, Channel, ChannelError, prove_as_trainer,
                                            prove_as_worker, rollout_secret, user_secret)
from turbogrpo.train.worker.local import TransportOptions
from turbogrpo.train.worker.protocol import Drawn, Request, RolloutDrawn

from .test_async import restore_threads  # noqa: F401 (a fixture)
from .test_remote_worker import free_port, refused_on_both_sides, remote, said
from .test_resume import REPO, subprocess_run_setup
from .tiny_run import overrides, write_model, write_rows

CPU = torch.device("cpu")


def tiny_spec(tmp_path, port: int, **extra) -> WorkerSpec:
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    config = load_config(None, overrides(model_dir, rows, tmp_path / "out", **remote(port, **extra)))
    return WorkerSpec.of(config.model, config.lora, config.rollout, config.env, config.train, config.algo,
                         config.draft, 1)


class Trainer:
    """A trainer rank's transport started on a thread (it waits for its worker), with one parameter ``w``."""

    def __init__(self, spec: WorkerSpec, port: int, timeout_s: float = 30.0):
        self.spec, self.transport, self.error = spec, None, None
        options = TransportOptions(None, port, timeout_s, "127.0.0.1", "", {"digest": "0" * 64, "path": "m"})

        def start():
            try:
                self.transport = RemoteTransport(spec, DistInfo(0, 1, 0, CPU), {"w": torch.arange(4.0)}, options)
            except BaseException as err:  # noqa: BLE001 (the test reads it)
                self.error = err
        self.thread = threading.Thread(target=start, daemon=True)
        self.thread.start()

    def ready(self) -> RemoteTransport:
        self.thread.join(60)
        if self.error is not None:
            raise self.error
        return self.transport


def worker_of(spec: WorkerSpec, port: int) -> tuple:
    """A worker's side connected to the trainer at 127.0.0.1:``port``, as ``turbogrpo rollout-worker`` connects."""
    return connect("127.0.0.1", port, 0, spec.sampling_settings(), 30.0, "")


def connected(port: int) -> socket.socket:
    """A connection to 127.0.0.1:``port`` once something listens there (the trainer starts on a thread)."""
    for _ in range(200):
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


def stranger(port: int, answer: bytes) -> bytes:
    """Connect as a stranger, read the trainer's opening, send ``answer``, return what comes back (b"" = closed)."""
    with connected(port) as sock:
        opening = secure_channel.read_exactly(sock, len(MAGIC) + NONCE_BYTES)
        assert opening.startswith(MAGIC)
        sock.sendall(answer)
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except ConnectionResetError:  # closed with our bytes unread
            pass
        return received


def test_strangers_read_nothing_and_the_first_worker_keeps_the_run(tmp_path, capfd):
    """Before the worker: a stranger with no secret (a forged proof, then HTTP) is told no and closed, having
    received only the trainer's opening (no settings, no weights); one with another secret is refused. The worker
    that proves the secret pairs; a second one is refused in one line on both sides, and the first still gets the
    weights, which cross encrypted (the wire never carries them in clear)."""
    port = free_port()
    spec = tiny_spec(tmp_path, port)
    trainer = Trainer(spec, port)
    forged = MAGIC + os.urandom(NONCE_BYTES) + os.urandom(32)
    assert stranger(port, forged) == b"\0"
    assert stranger(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 128) == b""
    with connected(port) as sock:
        with pytest.raises(ChannelError, match="refused this worker's secret"):
            prove_as_worker(sock, b"another secret of enough length")
    pair, theirs = worker_of(spec, port)
    transport = trainer.ready()
    assert theirs["base"] == {"digest": "0" * 64, "path": "m"}
    with pytest.raises(RolloutWorkerError) as second:
        worker_of(spec, port)
    assert "refused this worker: trainer rank 0 already has its rollout worker" in str(second.value)
    transport.publish(0, {"w": torch.arange(4.0) * 3})
    message = wire.receive(pair.channel, CPU)
    assert message.kind == "weights" and torch.equal(message.tensors["w"], torch.arange(4.0) * 3)
    transport.close()
    logged = said(capfd.readouterr().err)
    refusals = [line for line in logged if "refused" in line]
    assert len(refusals) == 4, logged
    # Each connection is admitted on its own thread, so the first three lines may come in any order.
    strangers = refusals[:3]
    assert sum("it does not hold the run's secret" in line for line in strangers) == 2, strangers
    assert sum("not a turbogrpo rollout worker" in line for line in strangers) == 1, strangers
    assert refusals[3].startswith("turbogrpo: rank 0 refused a second rollout worker from 127.0.0.1:")


def channels() -> tuple[Channel, Channel, socket.socket, socket.socket]:
    """Two proven channel ends over a socket pair (the real handshake, one thread each)."""
    a, b = socket.socketpair()
    secret, made = b"s" * 32, {}
    thread = threading.Thread(target=lambda: made.setdefault("trainer", prove_as_trainer(a, secret)))
    thread.start()
    worker = prove_as_worker(b, secret)
    thread.join()
    return made["trainer"], worker, a, b


def test_records_altered_replayed_or_from_another_connection_fail_to_open():
    """A record changed in one byte, the same record sent twice, or a record of another connection (same secret,
    other nonces, so other keys) fails authentication: one ChannelError line."""
    trainer, worker, _, _ = channels()
    trainer.send(b'{"kind": "stop", "layout": []}', torch.arange(40, dtype=torch.uint8))
    header, payload = worker.receive()
    assert header == b'{"kind": "stop", "layout": []}' and torch.equal(payload, torch.arange(40, dtype=torch.uint8))

    def recorded(channel: Channel, header: bytes) -> bytes:
        """What ``channel`` puts on the wire for ``header`` (and no payload)."""
        catch, keep = socket.socketpair()
        channel.sock = catch
        channel.send(header, torch.empty(0, dtype=torch.uint8))
        return keep.recv(1 << 16)

    def opened_by(channel: Channel, raw: bytes):
        feed, take = socket.socketpair()
        feed.sendall(raw)
        channel.sock = take
        return channel.receive()

    raw = recorded(trainer, b'{"kind": "request"}')
    altered = raw[:-20] + bytes([raw[-20] ^ 1]) + raw[-19:]
    with pytest.raises(ChannelError, match="failed authentication"):
        opened_by(worker, altered)
    _, worker, _, _ = channels()
    trainer2, _, _, _ = channels()
    with pytest.raises(ChannelError, match="failed authentication"):  # another connection's keys
        opened_by(worker, recorded(trainer2, b'{"kind": "request"}'))
    trainer, worker, _, _ = channels()
    raw = recorded(trainer, b'{"kind": "request"}')
    assert opened_by(worker, raw)[0] == b'{"kind": "request"}'
    with pytest.raises(ChannelError, match="failed authentication"):  # replayed: the counter moved on
        opened_by(worker, raw)
    with pytest.raises(ChannelError, match="announced a header record of"):
        opened_by(worker, struct.pack(">Q", 1 << 40))


def test_a_peer_that_is_not_the_trainer_is_named_by_the_worker(tmp_path):
    """An impostor that sends the opening and then accepts any proof cannot prove the secret back: the worker
    refuses it in one line. A trainer that refuses the worker's secret says so."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def impostor():
        connection, _ = server.accept()
        connection.sendall(MAGIC + os.urandom(NONCE_BYTES))
        secure_channel.read_exactly(connection, len(MAGIC) + NONCE_BYTES + 32)
        connection.sendall(b"\1" + os.urandom(32))
        connection.close()
    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(RolloutWorkerError) as err:
        connect("127.0.0.1", port, 0, {}, 10.0, "")
    assert str(err.value) == (f"the peer at 127.0.0.1:{port} is not this run's trainer: it does not hold the run's "
                              "secret: it is not this run's trainer")
    server.close()


def test_the_secret_comes_from_the_environment_or_a_file_and_never_travels_unset(tmp_path, monkeypatch):
    monkeypatch.delenv(secure_channel.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="is not loopback and no secret is set: .* set TURBOGRPO_ROLLOUT_SECRET"):
        rollout_secret("", "0.0.0.0")
    monkeypatch.setenv(secure_channel.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="has 5 characters; use at least 16"):
        rollout_secret("", "0.0.0.0")
    monkeypatch.setenv(secure_channel.SECRET_ENV, "a" * 20)
    assert rollout_secret("", "0.0.0.0") == b"a" * 20
    monkeypatch.delenv(secure_channel.SECRET_ENV)
    (tmp_path / "secret").write_text("b" * 32 + "\n")
    assert rollout_secret(str(tmp_path / "secret"), "10.1.2.3") == b"b" * 32
    with pytest.raises(ValueError, match="config key 'train.rollout_secret_file': cannot read"):
        rollout_secret(str(tmp_path / "missing"), "127.0.0.1")
    mine = rollout_secret("", "localhost")  # loopback: this user's own, made once, private
    path = secure_channel.cache_root() / "rollout" / "secret"
    assert mine == user_secret() == path.read_text().encode() and len(mine) == 64
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    with pytest.raises(ValueError, match="may be read by other users; `chmod 600"):
        user_secret()
    path.chmod(0o600)


def test_a_non_loopback_bind_without_a_secret_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(secure_channel.SECRET_ENV, raising=False)
    spec = tiny_spec(tmp_path, free_port())
    with pytest.raises(RolloutWorkerError) as err:
        RemoteTransport(spec, DistInfo(0, 1, 0, CPU), {"w": torch.zeros(1)},
                        TransportOptions(None, free_port(), 5.0, "0.0.0.0", ""))
    assert "connection on '0.0.0.0' is not loopback and no secret is set" in str(err.value)
    assert "\n" not in str(err.value)


def frame(header: bytes, payload: torch.Tensor | None = None) -> tuple[bytes, torch.Tensor]:
    return header, torch.empty(0, dtype=torch.uint8) if payload is None else payload


BAD_FRAMES = {
    "not_json": (frame(b"{oops"), "its header is not JSON"),
    "json_list": (frame(b"[1, 2]"), "its header is a JSON list, not an object"),
    "no_layout": (frame(b'{"kind": "rollout"}'), "its header has no 'layout'"),
    "no_kind": (frame(b'{"layout": []}'), "its header has no 'kind'"),
    "not_utf8": (frame(b'{"kind": "\xff\xfe"}'), "its header is not JSON"),
    "error_without_text": (frame(b'{"kind": "error", "layout": []}'), "it sent an error without its text"),
    "unknown_kind": (frame(b'{"kind": "weights", "layout": []}'), "it sent a message of kind 'weights'"),
    "step_not_a_number": (frame(b'{"kind": "rollout", "step": "7", "layout": []}'), "names step '7', not a number"),
    "rollout_without_groups": (frame(b'{"kind": "rollout", "step": 0, "layout": []}'),
                               "its 'rollout' message is malformed: field 'groups' is missing"),
    "tensor_outside_payload": (frame(b'{"kind": "rollout", "step": 0, "layout": [["x", "torch.int64", [4], 0, 32, '
                                     b'false]]}', torch.zeros(16, dtype=torch.uint8)),
                               "tensor 'x' lies outside the message's 16 payload bytes"),
    "shape_of_other_bytes": (frame(b'{"kind": "rollout", "step": 0, "layout": [["x", "torch.int64", [3], 0, 16, '
                                   b'false]]}', torch.zeros(16, dtype=torch.uint8)),
                             "tensor 'x''s shape [3] does not match its 16 bytes"),
}


@pytest.mark.parametrize("case", BAD_FRAMES, ids=list(BAD_FRAMES))
def test_every_bad_frame_from_the_worker_is_one_line(tmp_path, case):
    (header, payload), expected = BAD_FRAMES[case]
    port = free_port()
    spec = tiny_spec(tmp_path, port)
    trainer = Trainer(spec, port)
    pair, _ = worker_of(spec, port)
    transport = trainer.ready()
    pair.channel.send(header, payload)
    with pytest.raises(RolloutWorkerError) as err:
        transport.receive(0)
    message = str(err.value)
    assert message.startswith("the rollout worker (rank 0's, ") and "sent a bad message before step 1's rollout: " \
        in message and expected in message and "\n" not in message, message
    transport.close()


def test_bad_frames_from_the_trainer_end_the_worker_with_one_line(tmp_path):
    """The worker's side: a trainer whose settings message is not JSON, or whose later message is of an unknown kind,
    stops the worker with one line naming it."""
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))
    secret = user_secret()
    sent = iter([b"[]", b'{"kind": "spec", "settings": {}, "layout": []}'])

    def fake_trainer():
        for attempt in range(2):
            connection, _ = server.accept()
            channel = prove_as_trainer(connection, secret)
            channel.send(next(sent), torch.empty(0, dtype=torch.uint8))
            if attempt == 1:
                channel.receive()  # the hello
                channel.send(b'{"kind": "surprise", "layout": []}', torch.empty(0, dtype=torch.uint8))
    threading.Thread(target=fake_trainer, daemon=True).start()
    with pytest.raises(RolloutWorkerError) as err:
        connect("127.0.0.1", port, 0, {}, 10.0, "")
    assert str(err.value) == (f"the trainer at 127.0.0.1:{port} sent a bad message: its header is a JSON list, not "
                              "an object")
    pair, _ = connect("127.0.0.1", port, 0, {}, 10.0, "")
    link = RemoteLink(pair, 2)
    link.open()
    assert link.next_request() is None
    assert link.ending == "the trainer's message was bad (it sent a message of kind 'surprise' (a trainer sends " \
                          "weights, request or stop))"
    link.close()
    server.close()


def worker_command(config, sets: list[str], trainer: str) -> list[str]:
    return [sys.executable, "-m", "turbogrpo", "rollout-worker", str(config), "--trainer", trainer, "--set", *sets]


def run_worker(tmp_path, trainer: str, **extra) -> subprocess.CompletedProcess:
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    sets = overrides(model_dir, rows, tmp_path / "out", **remote(29600, **{"train.rollout_connect_timeout_s": 3,
                                                                        **extra}))
    return subprocess.run(worker_command(config, sets, trainer), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


class Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.parametrize("peer", ["http_server", "torch_store", "nobody"])
def test_a_worker_pointed_at_something_else_says_so_in_one_line(tmp_path, peer):
    """An HTTP server, torchrun's own TCPStore, or nothing listening: one line, exit 1, no traceback, within the
    handshake's few seconds."""
    port = free_port()
    keep = None
    if peer == "http_server":
        keep = http.server.HTTPServer(("127.0.0.1", port), Quiet)
        threading.Thread(target=keep.serve_forever, daemon=True).start()
    elif peer == "torch_store":
        keep = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    done = run_worker(tmp_path, f"127.0.0.1:{port}")
    if peer == "http_server":
        keep.shutdown()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = said(done.stderr)[-1]
    expected = {"http_server": f"is not this run's trainer: it is not a turbogrpo trainer (it did not begin the "
                               f"handshake within {secure_channel.HANDSHAKE_S:g} s)",
                "torch_store": "is not this run's trainer: it is not a turbogrpo trainer",
                "nobody": f"no trainer listening at 127.0.0.1:{port} within 3 s"}[peer]
    assert last.startswith("turbogrpo: error: ") and expected in last, done.stderr[-3000:]


@pytest.mark.parametrize("trainer, sets, expected", [
    ("127.0.0.1:99999", {}, "--trainer PORT + rank = 99999 + 0 is not a TCP port (1..65535)"),
    ("127.0.0.1", {}, "--trainer '127.0.0.1': expected HOST:PORT"),
    ("127.0.0.1:29600", {"train.rollout_connect_timeout_s": 1e14},
     "config key 'train.rollout_connect_timeout_s': 100000000000000.0 is not allowed; expected a number of seconds in "
     "(0, 604800] (a week)"),
], ids=["port_out_of_range", "no_port", "endless_timeout"])
def test_bad_addresses_and_timeouts_are_one_line(tmp_path, trainer, sets, expected):
    done = run_worker(tmp_path, trainer, **sets)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert expected in said(done.stderr)[-1], done.stderr[-3000:]


def test_the_trainer_refuses_an_endless_timeout_and_a_port_past_the_range(tmp_path):
    model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
    with pytest.raises(ConfigError, match="rollout_connect_timeout_s': 100000000000000.0 is not allowed; expected a number of seconds in"):
        load_config(None, overrides(model_dir, rows, tmp_path / "o", **remote(1, **{
            "train.rollout_connect_timeout_s": 1e14})))
    spec = tiny_spec(tmp_path, 65535)
    with pytest.raises(ValueError, match=r"train.rollout_port \+ rank = 65535 \+ 1 is not a TCP port"):
        RemoteTransport(spec, DistInfo(1, 2, 1, CPU), {"w": torch.zeros(1)},
                        TransportOptions(None, 65535, 5.0, "127.0.0.1", ""))


# --- what the trainer checks in a rollout -------------------------------------------------------------------


def drawn_for(prompts: list[torch.Tensor], completions: list[torch.Tensor], sizes, **fields) -> Drawn:
    groups = Groups(prompts, completions, sizes, **fields)
    return Drawn(Rollout(groups, RolloutStats()))


def test_a_rollout_is_checked_against_its_request():
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    request = Request(3, 0, 2, prompts, [])
    good = [torch.tensor([6, 7]), torch.tensor([8]), torch.tensor([9, 9, 9]), torch.tensor([], dtype=torch.long)]
    check = dict(num_generations=2, vocab_size=10, rows={})
    check_rollout(request, drawn_for(prompts, good, (2, 2)), **check)
    cases = [
        (drawn_for([prompts[1], prompts[0]], good, (2, 2)), "group 0's prompt is not the prompt asked"),
        (drawn_for(prompts[:1], good[:2], (2,)), "it has 1 groups for the 2 prompts asked"),
        (drawn_for(prompts, good[:3], (2, 1)), "its groups have [2, 1] completions where each has 2"),
        (drawn_for(prompts, [*good[:3], torch.tensor([10])], (2, 2)),
         "completion 3 has token ids outside the vocabulary [0, 10)"),
        (drawn_for(prompts, [*good[:3], torch.tensor([-1])], (2, 2)), "outside the vocabulary"),
        (drawn_for(prompts, [*good[:3], torch.tensor([0.5])], (2, 2)), "completion 3 is a torch.float32 tensor"),
        (drawn_for(prompts, good, (2, 2), sampler_logps=[torch.zeros(2)] * 4),
         "its sampler_logps do not have one value per completion token"),
    ]
    for drawn, expected in cases:
        with pytest.raises(RolloutMismatch, match=re.escape(expected)):
            check_rollout(request, drawn, **check)
    rows = {7: PromptExample("q", prompts[0], index=7)}
    partial = Request(3, 0, 2, [], [], num_groups=1)
    ok = drawn_for(prompts[:1], good[:2], (2,))
    ok.examples = [rows[7]]
    check_rollout(partial, ok, num_generations=2, vocab_size=10, rows=rows)
    ok.examples = [PromptExample("q", prompts[0], index=8)]
    with pytest.raises(RolloutMismatch, match=r"it names prompt rows \[8\] that this run does not have"):
        check_rollout(partial, ok, num_generations=2, vocab_size=10, rows=rows)


def test_a_rollout_of_another_step_or_with_other_prompts_stops_the_run_in_one_line(tmp_path, restore_threads,  # noqa: F811
                                                                                   monkeypatch):
    """Through the loop (the local transport standing in for any worker): a worker that answers step 0's request with
    a rollout labelled step 7, or with other prompts, stops the run with one line naming the worker; no assert
    (``python -O`` would drop it)."""
    from turbogrpo.train.worker import rollout_worker

    real = rollout_worker.TRANSPORTS["local"]
    for forge, expected in [(lambda message: dataclasses.replace(message, step=7), "it sent a rollout message for "
                             "step 7 where step 0's rollout was due"),
                            (lambda message: RolloutDrawn(message.step, _other_prompts(message.drawn)),
                             "group 0's prompt is not the prompt asked")]:
        class Forged(real):
            def receive(self, step, forge=forge):
                message = super().receive(step)
                return forge(message) if isinstance(message, RolloutDrawn) else message
        monkeypatch.setitem(rollout_worker.TRANSPORTS, "local", Forged)
        model_dir, rows = write_model(tmp_path / "model"), write_rows(tmp_path / "rows.jsonl")
        sets = overrides(model_dir, rows, tmp_path / f"out{len(expected)}", **{
            "train.max_staleness": 1, "train.num_threads": 1, "train.rollout_threads": 1, "train.num_steps": 2})
        with pytest.raises(RolloutWorkerError) as err:
            train(load_config(None, sets))
        assert "sent a rollout that is not step 1's: " + expected in str(err.value) and "\n" not in str(err.value)


def _other_prompts(drawn: Drawn) -> Drawn:
    groups = drawn.rollout.groups
    groups.prompts = [torch.flip(p, (0,)) + 0 for p in groups.prompts]
    return drawn


# --- base weights -------------------------------------------------------------------------------------------


def test_a_lora_worker_with_other_base_weights_is_refused_naming_both_paths(tmp_path, restore_threads):  # noqa: F811
    """In a LoRA run only the adapters travel: a worker that loaded another model of the same shapes is refused
    before the first rollout, in one line on each side naming both model paths (it trained 3 steps with a
    log-prob gap of 1.4 before)."""
    model_dir, rows, config, env = subprocess_run_setup(tmp_path)
    other = write_model(tmp_path / "other", seed=1)
    port = free_port()
    lora = {"lora.enabled": "true", "lora.r": 4}
    sets = overrides(model_dir, rows, tmp_path / "out", **remote(port, **lora))
    err, returncode, worker_err = refused_on_both_sides(config, sets, [*sets, f'model.path="{other}"'], env, port)
    expected = (f"this worker's base weights (model.path '{other}') differ from the trainer's (model.path "
                f"'{model_dir}')")
    assert expected in str(err) and "\n" not in str(err)
    assert returncode == 1 and "Traceback" not in worker_err, worker_err[-3000:]
    assert expected in said(worker_err)[-1], worker_err[-3000:]
