"""The one HTTP transport every edge uses: the gateway's engine adapters, the replayer and the
calibration client.

* :mod:`.retry` — the one retry rule (send again only while nothing came back; bounded
  attempts and backoff).
* :mod:`.client` — :class:`~.client.HttpTransport`, async: the measured fast path
  (:mod:`.fast`) for plain ``http``, ``httpx`` otherwise (imports ``httpx``: the gateway extra).
* :mod:`.blocking` — the same rule for blocking callers that time-stamp every streamed line
  (the calibration client's threads); standard library only.

It imports nothing of turnstile: every layer may use it.
"""

from turnstile.transport.retry import RetryRule, retry_async, retry_sync

__all__ = ["PROBE_HEADER", "RetryRule", "retry_async", "retry_sync"]

#: marks a request turnstile sends to learn about a server (replay's tokenizer calibration, the
#: gateway's start-up check), not to serve work: a gateway serves it and does not record it
PROBE_HEADER = "x-turnstile-probe"
