"""Authenticated framing for the agent <-> coordinator link.

Every ZeroMQ message is three frames: a version tag, an HMAC-SHA256 of the payload keyed by the
per-job secret, and the msgpack payload (a tagged struct from `wire.messages`). The coordinator
listens on a network port, so anything arriving there is untrusted: the Codec turns bad input into
`None` plus a counted reason, and never raises, so one stray or hostile sender cannot crash it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter
from typing import Any

import msgspec

from trainscout.wire.messages import Command, ToCoordinator

VERSION = b"TS1"
MAC_SIZE = 32  # bytes of an HMAC-SHA256 digest
MIN_SECRET_SIZE = 16
DEFAULT_MAX_PAYLOAD = 16 * 1024 * 1024

# Reasons counted in Codec.rejected.
REJECT_FRAMES = "frames"
REJECT_VERSION = "version"
REJECT_MAC = "mac"
REJECT_MALFORMED = "malformed"
REJECT_OVERSIZE = "oversize"


class Codec:
    """Encodes messages into signed frames and checks/decodes frames from the other side."""

    def __init__(self, secret: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_SIZE:
            raise ValueError(f"the job secret must be at least {MIN_SECRET_SIZE} bytes")
        self._secret = bytes(secret)
        self.max_payload = max_payload
        self.rejected: Counter[str] = Counter()
        # Built once: msgspec encoders/decoders are cheap to reuse and costly to rebuild per message.
        self._encoder = msgspec.msgpack.Encoder()
        self._to_coordinator = msgspec.msgpack.Decoder(ToCoordinator)
        self._to_agent = msgspec.msgpack.Decoder(Command)

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()

    def encode(self, msg: msgspec.Struct) -> list[bytes]:
        payload = self._encoder.encode(msg)
        return [VERSION, self._mac(payload), payload]

    def decode_to_coordinator(self, frames: list[bytes]) -> Any | None:
        """A message from the `ToCoordinator` union, or None if the frames were rejected."""
        return self._decode(frames, self._to_coordinator)

    def decode_to_agent(self, frames: list[bytes]) -> Command | None:
        return self._decode(frames, self._to_agent)

    def _decode(self, frames: list[bytes], decoder: msgspec.msgpack.Decoder) -> Any | None:
        payload = self._verified_payload(frames)
        if payload is None:
            return None
        try:
            return decoder.decode(payload)
        except Exception:  # msgspec.DecodeError / ValidationError, or anything unexpected
            self.rejected[REJECT_MALFORMED] += 1
            return None

    def _verified_payload(self, frames: list[bytes]) -> bytes | None:
        try:
            if len(frames) != 3:
                self.rejected[REJECT_FRAMES] += 1
                return None
            version, mac, payload = (bytes(f) for f in frames)
        except Exception:  # not a sequence of buffers at all
            self.rejected[REJECT_FRAMES] += 1
            return None
        if version != VERSION:
            self.rejected[REJECT_VERSION] += 1
            return None
        # Size before MAC: hashing a huge hostile payload is itself a cost worth refusing.
        if len(payload) > self.max_payload:
            self.rejected[REJECT_OVERSIZE] += 1
            return None
        if len(mac) != MAC_SIZE or not hmac.compare_digest(mac, self._mac(payload)):
            self.rejected[REJECT_MAC] += 1
            return None
        return payload
