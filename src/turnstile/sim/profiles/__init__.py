"""The profiles of the real engines turnstile models, one module each; importing this package
registers them (:func:`turnstile.sim.engine_profile.profile_for` does, on first use).

Engine-specific facts belong here and nowhere else in ``core/`` or the general engine model
(``tests/test_engine_names.py`` checks it).
"""

from turnstile.sim.profiles import llamacpp, vllm

__all__ = ["llamacpp", "vllm"]
