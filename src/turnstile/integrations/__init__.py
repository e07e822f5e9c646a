"""Adapters that plug the scheduler core into stacks users already run (verl's rollout router).

Each module here is an edge: it imports turnstile's core, policies and workload model, never
the drivers (sim, gateway, rollout), and it imports the foreign stack (verl, Ray) lazily or not
at all, so turnstile never requires it. Nothing in turnstile imports this package.
"""
