"""The shared-secret check of every worker call and of the controller's API key."""

from __future__ import annotations

import hmac


def bearer_ok(authorization: str | None, secret: str) -> bool:
    """True when an Authorization header is `Bearer <secret>` (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), secret.encode())
