"""The runtime around Flower and Ray, imported only by the adapters (:mod:`fedelastic.fl`): the
patches of their private code (:mod:`.patches`), Ray's start and shutdown for a run
(:mod:`.lifecycle`), Flower's crash-tolerant Ray backend (:mod:`.backend`) and dispatch loop
(:mod:`.dispatch`), a local multi-node Ray cluster for tests and benchmarks (:mod:`.cluster`), and
the clean-up of the Ray processes a killed run left behind (:mod:`.orphans`). It imports nothing
from :mod:`fedelastic.fl` (``tests/unit/test_imports.py``)."""
