"""``python -m turnstile.gateway serve|replay ...`` (the same commands as ``turnstile``)."""

from turnstile.gateway.cli import main

main()
