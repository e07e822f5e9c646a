"""``turnstile epp``: the scheduler core as a Gateway API Inference Extension endpoint picker.

Envoy (or any data plane speaking the endpoint-picker protocol over ext_proc) stays the byte
path; the picker decides where each request goes and when: the same session resolution, policy
objects and holding queue as ``turnstile serve`` (it *is* the gateway's service with a different
relay, :mod:`.picker`), answered over Envoy's ext_proc stream (:mod:`.extproc`), in a process
with gRPC health and Prometheus metrics (:mod:`.server`). :mod:`.envoy` writes the Envoy config
(``deploy/envoy.yaml``) and runs Envoy for tests. See ``docs/epp.md``.


Importing this package imports nothing else: the CLI registers ``epp`` without the ``epp``
extra's packages (grpcio, xds-protos) installed.
"""
