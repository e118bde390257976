"""The blob tier's credentials and region: from the environment, else the host keychain.

Rules:
  * ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (and
    ``AWS_SESSION_TOKEN``) from the environment if both keys are set, else
    the two keys from the host keychain (``capsulefs secret set NAME``).
    Never from a capsule, never from ``fleet.json``.
  * The region to sign for: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, else
    ``us-east-1``.
  * Missing or unusable credentials are one :class:`TierCredentialsError` line.

Theory of operation: ``capsulefs fleet check-blobs`` and the daemon (a
mount with ``--blobs``) both call :func:`tier_credentials`; the mount calls
it before it forks, so a missing key is said on the terminal.
"""

from __future__ import annotations

import os

from capsulefs.core.fleet.errors import FleetError
from capsulefs.core.fleet.sigv4 import Credentials

__all__ = ["ACCESS_KEY", "SECRET_KEY", "SESSION_TOKEN", "TierCredentialsError", "tier_credentials", "tier_region"]

ACCESS_KEY = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN = "AWS_SESSION_TOKEN"


class TierCredentialsError(FleetError):
    """No usable credentials for the blob tier."""


def tier_credentials(state_dir: str) -> Credentials:
    """The blob tier's credentials (see the rules); TierCredentialsError: one line."""
    access, secret = os.environ.get(ACCESS_KEY), os.environ.get(SECRET_KEY)
    token = None
    if access and secret:
        token = os.environ.get(SESSION_TOKEN) or None
    else:
        from capsulefs.agents import keychain

        try:
            found = keychain.fetch(state_dir, [ACCESS_KEY, SECRET_KEY])
        except keychain.MissingSecret:
            raise TierCredentialsError(
                f"no credentials for the blob tier: set {ACCESS_KEY} and {SECRET_KEY} in the environment, "
                f"or in the keychain with 'capsulefs secret set NAME'") from None
        access, secret = found[ACCESS_KEY], found[SECRET_KEY]
    try:
        return Credentials(access, secret, token)
    except ValueError as exc:
        raise TierCredentialsError(f"unusable blob tier credentials: {exc}") from None


def tier_region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
