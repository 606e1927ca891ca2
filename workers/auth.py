"""The shared-secret check of every worker call and of the controller's API keys."""

from __future__ import annotations

import hashlib
import hmac


def _digest(text: str) -> bytes:
    # Equal-length digests: compare_digest's time then depends on neither the secret's length nor the token's.
    # surrogatepass: a header's text is Latin-1 and always encodes; a secret from a file might hold anything
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def proof(secret: str, challenge: str) -> str:
    """Proof that the answerer holds `secret`, without sending it: HMAC-SHA256 of the challenge (hex)."""
    return hmac.new(_digest(secret), challenge.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def proof_ok(secret: str, challenge: str, given) -> bool:
    """Whether `given` is proof(secret, challenge), compared in constant time."""
    return isinstance(given, str) and hmac.compare_digest(_digest(given), _digest(proof(secret, challenge)))


def bearer_ok(authorization: str | None, secret: str) -> bool:
    """True when an Authorization header is `Bearer <secret>` (compared in constant time)."""
    return any_bearer_ok(authorization, (secret,))


def any_bearer_ok(authorization: str | None, secrets: tuple[str, ...] | list[str]) -> bool:
    """True when an Authorization header is `Bearer <one of the secrets>`. Every secret is compared, each in
    constant time, so the time taken tells nothing of which one matched or how much of any matched."""
    scheme, _, token = (authorization or "").partition(" ")
    given = _digest(token.strip())
    matched = False
    for secret in secrets:
        matched |= hmac.compare_digest(given, _digest(secret))
    return scheme.lower() == "bearer" and matched and bool(secrets)
