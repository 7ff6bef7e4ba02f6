"""The backends behind `ElasticBuffer`: one package per backend, all behind one interface.

- `deep_ep.backends.base`: the interface (`EPBackend`), its request and result dataclasses.
- `deep_ep.backends.reference`: torch collectives on any process group (the oracle).
- `deep_ep.backends.kernels`: the JIT-compiled kernels over peer windows (one NVLink domain, or
  the virtual ranks of one GPU).

Importing this package imports no backend: each loads when it is first chosen.
"""
