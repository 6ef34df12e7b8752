"""The remote rollout worker's connection: one TCP socket on which both sides first prove that they hold the run's
secret, then exchange records that are encrypted and authenticated (AES-256-GCM).

    trainer (listens on train.rollout_host)                    worker (connects)
    MAGIC, nonce_t (32 random bytes)            ───────────►   checks MAGIC (else: "not a turbogrpo trainer")
                                                ◄───────────   MAGIC, nonce_w, HMAC(secret, "worker" | nonce_t | nonce_w)
    checks the worker's proof; 1, HMAC(secret, "trainer" | nonce_t | nonce_w)  ──►  checks the trainer's proof
    (0 and the connection closed where the proof is wrong)
    keys: HMAC(secret, "trainer->worker" | nonces), HMAC(secret, "worker->trainer" | nonces)

The secret never travels, and each connection gets keys of its own (fresh nonces from both sides), so a recorded
handshake replayed later yields keys its sender cannot compute. Every later record is AES-GCM under its direction's
key, its nonce a counter: a record altered, dropped, replayed or reordered fails to decrypt. So nobody without the
secret can read the weights, write a message, or take a connection over after the handshake.

A message is one header record (the payload's size, 8 bytes, then the header's bytes), preceded by its ciphertext's
size in clear (bounded by ``MAX_HEADER_BYTES`` before anything is allocated, and authenticated as the record's
associated data), then the payload in records of ``CHUNK_BYTES`` (their sizes follow from the header's: nothing else
in clear). AES-GCM runs at several GB/s with AES-NI: SmolLM2-135M's weights (540 MB) cost about 0.3 s a version
each way (``bench/remote_channel.py``).

Where the secret comes from (``rollout_secret``): ``$TURBOGRPO_ROLLOUT_SECRET``, else the file
train.rollout_secret_file names, else, on loopback only, this user's own secret in turbogrpo's cache folder (made
once, readable by this user alone), which every process of the user on this machine shares.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
import struct
from pathlib import Path

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from turbogrpo.cache import cache_root

SECRET_ENV = "TURBOGRPO_ROLLOUT_SECRET"
MIN_SECRET_CHARS = 16
"""The shortest secret accepted (``secrets.token_hex(32)`` gives 64 characters)."""
MAGIC = b"turbogrpo rollout channel v1\n"
NONCE_BYTES = 32
PROOF_BYTES = 32
HANDSHAKE_S = 5.0
"""How long either side waits for the other's part of the handshake (a peer that says nothing is not ours)."""
MAX_HEADER_BYTES = 64 << 20
"""The largest header record accepted (a version's header lists its tensors: kilobytes)."""
CHUNK_BYTES = 16 << 20
"""Payload bytes per record (AES-GCM takes under 2 GiB per call; smaller records overlap sending and sealing)."""
TAG_BYTES = 16
GENERATE_HINT = "python -c 'import secrets; print(secrets.token_hex(32))'"


class ChannelError(ConnectionError):
    """The peer is not who it must be, or what it sent is not a message of this channel; one line saying which."""


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is this machine's loopback."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def rollout_secret(secret_file: str, host: str) -> bytes:
    """The run's secret for a connection on ``host`` (the trainer's bind address, or the trainer a worker connects
    to): ``$TURBOGRPO_ROLLOUT_SECRET``, else the file ``secret_file`` (train.rollout_secret_file), else on loopback
    this user's own (``user_secret``). Elsewhere none is a ValueError: a port on a network admits only a peer
    holding a secret given to both machines."""
    if os.environ.get(SECRET_ENV):
        secret, source = os.environ[SECRET_ENV].strip(), f"${SECRET_ENV}"
    elif secret_file:
        path = Path(secret_file).expanduser()
        try:
            secret, source = path.read_text().strip(), f"train.rollout_secret_file ({path})"
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"config key 'train.rollout_secret_file': cannot read {path} "
                             f"({getattr(err, 'strerror', None) or err})") from None
    elif is_loopback(host):
        return user_secret()
    else:
        raise ValueError(f"the rollout worker's connection on {host!r} is not loopback and no secret is set: a port "
                         f"on a network admits only a peer that proves it holds the run's secret; set {SECRET_ENV} "
                         f"(or train.rollout_secret_file) to the same secret on both machines, e.g. `{GENERATE_HINT}` "
                         "(docs/guide/distributed.md)")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the rollout secret from {source} has {len(secret)} characters; use at least "
                         f"{MIN_SECRET_CHARS}, e.g. `{GENERATE_HINT}`")
    return secret.encode()


def user_secret() -> bytes:
    """This user's secret for loopback connections: ``<cache>/rollout/secret``, made once (mode 0600, in a 0700
    folder) and refused where others may read it."""
    path = cache_root() / "rollout" / "secret"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_hex(32))
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"the rollout secret {path} may be read by other users; `chmod 600 {path}` (or delete "
                             f"it: a new one is made) or set {SECRET_ENV}")
        secret = path.read_text().strip()
    except OSError as err:
        raise ValueError(f"cannot keep the rollout secret in {path} ({err.strerror or err}); set {SECRET_ENV}, or "
                         "TURBOGRPO_CACHE to a writable folder") from None
    if len(secret) < MIN_SECRET_CHARS:  # (a file cut short: written by a process that was killed)
        raise ValueError(f"the rollout secret {path} is damaged; delete it (a new one is made) or set {SECRET_ENV}")
    return secret.encode()


def _mac(secret: bytes, label: bytes, nonce_t: bytes, nonce_w: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + nonce_t + nonce_w, hashlib.sha256).digest()


class Channel:
    """An authenticated, encrypted connection (``prove_as_trainer`` / ``prove_as_worker`` make one). ``send``
    and ``receive`` may run at once on two threads (one sender and one receiver at a time)."""

    def __init__(self, sock: socket.socket, send_key: bytes, receive_key: bytes):
        self.sock = sock
        self._sealer, self._opener = AESGCM(send_key), AESGCM(receive_key)
        self._sent = self._received = 0

    def send(self, header: bytes, payload: torch.Tensor) -> None:
        """One message: ``header`` (bytes) and ``payload`` (``[B]`` uint8, on the host)."""
        size = payload.numel()
        sealed = self._seal(struct.pack(">Q", size) + header, struct.pack(">Q", len(header) + 8 + TAG_BYTES))
        self.sock.sendall(struct.pack(">Q", len(sealed)) + sealed)
        data = memoryview(payload.numpy()) if size else memoryview(b"")
        for start in range(0, size, CHUNK_BYTES):
            self.sock.sendall(self._seal(data[start:start + CHUNK_BYTES], b""))

    def receive(self) -> tuple[bytes, torch.Tensor]:
        """The next message's header and payload (``[B]`` uint8); ChannelError where a record fails to decrypt,
        ConnectionError where the peer is gone."""
        (length,) = struct.unpack(">Q", self._read(8))
        if not TAG_BYTES + 8 <= length <= MAX_HEADER_BYTES:
            raise ChannelError(f"a message announced a header record of {length} bytes (allowed: "
                               f"{TAG_BYTES + 8}..{MAX_HEADER_BYTES})")
        plain = self._open(self._read(length), struct.pack(">Q", length))
        (size,) = struct.unpack(">Q", plain[:8])
        try:
            payload = torch.empty(size, dtype=torch.uint8)
        except RuntimeError as err:
            raise ChannelError(f"a message announced a payload of {size} bytes, which this machine cannot hold "
                               f"({str(err).splitlines()[0]})") from None
        into = payload.numpy()
        for start in range(0, size, CHUNK_BYTES):
            count = min(CHUNK_BYTES, size - start)
            into[start:start + count] = np.frombuffer(self._open(self._read(count + TAG_BYTES), b""), np.uint8)
        return plain[8:], payload

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer
        self.sock.close()

    def _seal(self, data, associated: bytes) -> bytes:
        nonce = struct.pack(">4xQ", self._sent)
        self._sent += 1
        return self._sealer.encrypt(nonce, data, associated)

    def _open(self, data: bytes | bytearray, associated: bytes) -> bytes:
        nonce = struct.pack(">4xQ", self._received)
        self._received += 1
        try:
            return self._opener.decrypt(nonce, data, associated)
        except InvalidTag:
            raise ChannelError("a message failed authentication (altered, replayed or not from the peer that "
                               "proved the secret)") from None

    def _read(self, count: int) -> bytearray:
        return read_exactly(self.sock, count)


def read_exactly(sock: socket.socket, count: int) -> bytearray:
    """``count`` bytes from ``sock`` (as read: no copy); ConnectionError where the peer closed the connection
    first."""
    buffer = bytearray(count)
    view, done = memoryview(buffer), 0
    while done < count:
        got = sock.recv_into(view[done:], count - done)
        if not got:
            raise ConnectionError("the connection closed")
        done += got
    return buffer


@contextlib.contextmanager
def _handshake(sock: socket.socket, silent: str, left: str):
    """The block of one side's handshake, ``HANDSHAKE_S`` at most: a peer that says nothing in time is
    ChannelError ``silent``; one that closes the connection is ChannelError ``left`` with the reason."""
    sock.settimeout(HANDSHAKE_S)
    try:
        yield
    except ChannelError:
        raise
    except (TimeoutError, socket.timeout):
        raise ChannelError(silent) from None
    except ConnectionError as err:
        raise ChannelError(f"{left} ({err})") from None
    sock.settimeout(None)


def _channel(sock: socket.socket, secret: bytes, nonce_t: bytes, nonce_w: bytes, *, side: str) -> Channel:
    """The proven connection of ``side`` ("trainer" or "worker"): it seals with its own direction's key and opens
    with the other's (both derived from the secret and this connection's nonces)."""
    other = "worker" if side == "trainer" else "trainer"
    return Channel(sock, _mac(secret, f"{side}->{other}".encode(), nonce_t, nonce_w),
                   _mac(secret, f"{other}->{side}".encode(), nonce_t, nonce_w))


def prove_as_trainer(sock: socket.socket, secret: bytes) -> Channel:
    """The trainer's handshake on an accepted connection (``HANDSHAKE_S`` at most): a peer that does not prove it
    holds ``secret`` is told no and raises ChannelError."""
    nonce_t = secrets.token_bytes(NONCE_BYTES)
    with _handshake(sock, f"it did not answer the handshake within {HANDSHAKE_S:g} s", "it left during the handshake"):
        sock.sendall(MAGIC + nonce_t)
        answer = read_exactly(sock, len(MAGIC) + NONCE_BYTES + PROOF_BYTES)
        if not answer.startswith(MAGIC):
            raise ChannelError(f"it is not a turbogrpo rollout worker (it sent {bytes(answer[:24])!r})")
        nonce_w, proof = bytes(answer[len(MAGIC):-PROOF_BYTES]), answer[-PROOF_BYTES:]
        if not hmac.compare_digest(proof, _mac(secret, b"worker", nonce_t, nonce_w)):
            sock.sendall(b"\0")
            raise ChannelError("it does not hold the run's secret")
        sock.sendall(b"\1" + _mac(secret, b"trainer", nonce_t, nonce_w))
    return _channel(sock, secret, nonce_t, nonce_w, side="trainer")


def prove_as_worker(sock: socket.socket, secret: bytes) -> Channel:
    """The worker's handshake on a connection to its trainer (``HANDSHAKE_S`` at most): a peer that is not a
    turbogrpo trainer, or does not hold ``secret``, raises ChannelError."""
    with _handshake(sock, f"it is not a turbogrpo trainer (it did not begin the handshake within {HANDSHAKE_S:g} s)",
                    "it is not a turbogrpo trainer, or it closed the connection"):
        opening = read_exactly(sock, len(MAGIC) + NONCE_BYTES)
        if not opening.startswith(MAGIC):
            raise ChannelError(f"it is not a turbogrpo trainer (it sent {bytes(opening[:24])!r})")
        nonce_t, nonce_w = bytes(opening[len(MAGIC):]), secrets.token_bytes(NONCE_BYTES)
        sock.sendall(MAGIC + nonce_w + _mac(secret, b"worker", nonce_t, nonce_w))
        if read_exactly(sock, 1) != b"\1":
            raise ChannelError(f"it refused this worker's secret: set the same {SECRET_ENV} (or "
                               "train.rollout_secret_file) on both machines")
        if not hmac.compare_digest(read_exactly(sock, PROOF_BYTES), _mac(secret, b"trainer", nonce_t, nonce_w)):
            raise ChannelError("it does not hold the run's secret: it is not this run's trainer")
    return _channel(sock, secret, nonce_t, nonce_w, side="worker")
