"""What the gateway logs, and what it never does.

* At ``info`` and above: engine state changes, failed attempts (request id, engine, reason),
  restores and take-overs. Never a prompt, a completion or a request body: those are the
  clients' data (the recorder keeps counts and hashes only, :mod:`.recorder`).
* The control-plane calls the gateway makes many times a second (engine ``/health``,
  ``/metrics``, ``/slots``, ``/tokenize``, ``/v1/models``) go through ``httpx``, which logs each
  request at ``info``: :func:`quiet_probe_logs` moves those lines to ``debug`` (they appear when
  the ``turnstile.gateway`` logger is at ``debug``).
"""

from __future__ import annotations

import logging

__all__ = ["quiet_probe_logs"]

_GATEWAY = logging.getLogger("turnstile.gateway")


class _ProbesAtDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        if not _GATEWAY.isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_FILTER = _ProbesAtDebug()


def quiet_probe_logs() -> None:
    """Idempotent: ``httpx``'s per-request ``info`` lines become ``debug``."""
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
