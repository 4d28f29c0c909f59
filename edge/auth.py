"""Who is calling: bearer tokens (``authorization: Bearer <token>`` call metadata) and mTLS identity.

The principal a stream authenticates as is what a session is bound to: only the same principal,
holding the session's secret resume token, can resume it. Tokens are kept as sha256 digests and
compared in constant time.

Admission counts sessions per principal too (:func:`admission_principal`): the authenticated
identity, or, on an edge without authentication, the peer's host (not its port: one client opening
many connections is still one client).
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

BEARER = "bearer "
ANONYMOUS = "anonymous"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def load_tokens(path: str | Path) -> frozenset[str]:
    """Digests of the tokens in a file, one per line (blank lines and # comments ignored)."""
    lines = Path(path).read_text().splitlines()
    tokens = {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    if not tokens:
        raise ValueError(f"no tokens in {path}")
    return frozenset(token_digest(t) for t in tokens)


@dataclass(frozen=True)
class Authenticator:
    token_digests: frozenset[str] = frozenset()  # empty: no bearer token required
    require_client_cert: bool = False            # mTLS: the transport already verified the chain

    def principal(self, metadata, auth_context: dict) -> str | None:
        """The caller's identity, or None if it must be refused (UNAUTHENTICATED)."""
        identity = _cert_identity(auth_context)
        if self.require_client_cert and identity is None:
            return None
        if self.token_digests:
            digest = _bearer_digest(metadata)
            if digest is None or not any(hmac.compare_digest(digest, d) for d in self.token_digests):
                return None
            return f"token:{digest[:16]}" + (f"/{identity}" if identity else "")
        return identity or ANONYMOUS


def _bearer_digest(metadata) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str) and value.lower().startswith(BEARER):
            return token_digest(value[len(BEARER):].strip())
    return None


def _cert_identity(auth_context: dict) -> str | None:
    names = auth_context.get("x509_common_name") or auth_context.get("x509_subject_alternative_name")
    if not names:
        return None
    return "cert:" + names[0].decode(errors="replace")


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: ``ipv4:10.0.0.7:5123`` -> ``10.0.0.7``, ``ipv6:[::1]:5123``
    (or its %-encoded form) -> ``::1``, ``[::ffff:10.0.0.7]`` -> ``10.0.0.7``; anything else (``unix:...``) as it is."""
    scheme, sep, rest = unquote(peer or "").partition(":")
    if not sep or scheme not in ("ipv4", "ipv6"):
        return peer or "unknown"
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        host = rest
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    mapped = "::ffff:"  # an IPv4 client of a dual-stack socket is the same client
    return host[len(mapped):] if host.lower().startswith(mapped) and "." in host else host


def admission_principal(principal: str, peer: str) -> str:
    """Whom a new session counts against for the per-principal cap: the authenticated principal, or
    on an edge without authentication (everyone is ``anonymous``) the peer's host."""
    return f"peer:{peer_host(peer)}" if principal == ANONYMOUS else principal
