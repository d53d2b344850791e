"""Who may talk on the agent <-> coordinator link: CurveZMQ keys derived from the job secret.

The signed frames of `framing.Codec` prove a message came from someone holding the job secret, but not
which connection it came in on: a peer without the secret could still open a ZeroMQ connection under a
real agent's identity and take its route over (ROUTER_HANDOVER), or make the coordinator buffer a huge
multipart message before any frame is checked. CurveZMQ (libzmq's authenticated encryption) closes both
before a single message is read: a connection is refused at the handshake unless the client proves it
holds the client key and knew the server key, and each message carries a nonce, so bytes replayed into
a connection break it instead of being delivered twice.

Both key pairs are derived from the job secret, which every node already shares, so there is nothing
new to distribute. A ZAP handler (pyzmq's authenticator thread) then admits only the client key.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

# ZAP domain of the coordinator's socket; a connection to another domain is refused.
ZAP_DOMAIN = "trainscout"


class CurveUnavailable(RuntimeError):
    """The installed libzmq was built without CURVE (pyzmq's wheels always have it)."""


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveUnavailable(
            "this pyzmq/libzmq has no CURVE support, which trainscout needs to authenticate its peers; "
            "install pyzmq from its wheels (pip install --force-reinstall pyzmq)"
        )


def _keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of one role, the same on every node that holds the job secret."""
    _require_curve()
    raw = hmac.new(secret, b"trainscout/curve/" + role, hashlib.sha256).digest()  # 32 bytes, as Curve25519 wants
    private = z85.encode(raw)
    return zmq.curve_public(private), private


def server_keys(secret: bytes) -> tuple[bytes, bytes]:
    return _keypair(secret, b"server")


def client_keys(secret: bytes) -> tuple[bytes, bytes]:
    return _keypair(secret, b"client")


def secure_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make a DEALER (before connect) authenticate as an agent of this job."""
    server_public, _ = server_keys(secret)
    public, private = client_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, private)


class _OnlyOurClient:
    """ZAP credentials check: the one client key of this job, nothing else."""

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = domain == ZAP_DOMAIN and hmac.compare_digest(key, self._key)
        if not ok:
            self.denied += 1
        return ok


class ServerGuard:
    """Makes a ROUTER (before bind) a CURVE server that admits only this job's agents.

    Owns the ZAP authenticator thread of the socket's context; stop() it before the context terminates.
    """

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, secret: bytes) -> None:
        _, server_private = server_keys(secret)
        client_public, _ = client_keys(secret)
        self._check = _OnlyOurClient(client_public)
        self._auth: Any = zmq.auth.thread.ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._check)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, server_private)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    @property
    def denied(self) -> int:
        """Connections that completed a handshake with a key that is not this job's client key."""
        return self._check.denied

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
