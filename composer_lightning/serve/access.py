"""Who may call the endpoint, whose sessions are whose, and how often a client may ask.

- **Keys.** With `api_key` set, a request carries `Authorization: Bearer <key>` (the scheme in
  any case, RFC 7235 §2.1) with one of the keys, else it is refused (401).
- **Sessions are owned per key.** A session id names a session within its key's sessions only:
  the store keeps it as `session_key(key, id)`. Two clients with their own keys never reach each
  other's sessions, whatever ids they pick: none can score, continue or end another's, squat an
  id another will use, or learn which ids another has (the answer to an id is the same whether
  another key uses it or not: it is this key's own session).
- **No key: one tenant.** Without `api_key` every client is the same owner, and any client can
  continue, score or end any session it names; `serve` says so when it starts. That is the
  setting of one user's own agent harness on 127.0.0.1 (OpenClaw-RL's); several clients that
  must be kept apart get a key each (`api_key: [...]`).
- **Rate limits** count per key (a request without one: per address).
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from starlette.requests import Request

from composer_lightning.serve.protocol import ApiError

#: what `serve` prints at start without `api_key`
SINGLE_TENANT_NOTICE = (
    "composer_lightning: no api_key: one tenant, every client may continue, score or end any "
    "session it names; give each client its own key (rollout.api_key: [...]) to keep their "
    "sessions apart"
)


def bearer_token(header: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header ("" for none or another scheme);
    the scheme is matched in any case."""
    scheme, _, token = (header or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_tag(key: str) -> str:
    """A key's name in the store: a digest, so the store keeps no key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def session_key(api_key: str | None, session: str) -> str:
    """The store's name of session `session` of the client holding `api_key` (None: the one
    tenant of a server without keys, whose sessions keep the ids the client gave)."""
    return session if api_key is None else f"{key_tag(api_key)}/{session}"


@dataclass(frozen=True)
class Caller:
    """An authorised request's client.

    Attributes:
        key: the API key it presented (None on a server without keys).
        bucket: its rate-limit bucket (its token's digest, else its address).
    """

    key: str | None
    bucket: str

    def session(self, session: str) -> str:
        """The store's name of this client's session `session` (`session_key`)."""
        return session_key(self.key, session)


class Access:
    """The keys of one app.

    Args:
        api_key: the key clients must present, or a list of them (one per client); None: no
            keys, one tenant (module docstring).
    """

    def __init__(self, api_key: str | list[str] | None) -> None:
        keys = [api_key] if isinstance(api_key, str) else api_key
        self.keys = None if keys is None else set(keys)

    def caller(self, request: Request) -> Caller:
        """The request's client (401 without one of the keys)."""
        token = bearer_token(request.headers.get("authorization"))
        if self.keys is not None and token not in self.keys:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        address = request.client.host if request.client else "unknown"
        bucket = f"key {key_tag(token)}" if token else f"address {address}"
        return Caller(None if self.keys is None else token, bucket)


class RateLimiter:
    """At most `per_minute` requests per bucket in any 60 s window."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._seen: defaultdict[str, deque[float]] = defaultdict(deque)

    def allow(self, bucket: str) -> bool:
        """Whether one more request of `bucket` fits in the window (and count it)."""
        now, seen = time.monotonic(), self._seen[bucket]
        while seen and seen[0] <= now - 60:
            seen.popleft()
        if len(seen) >= self.per_minute:
            return False
        seen.append(now)
        return True
