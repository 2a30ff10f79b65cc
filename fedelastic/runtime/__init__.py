"""The runtime around Flower and Ray: the patches of their private code (:mod:`.patches`), a
local multi-node Ray cluster for tests and benchmarks (:mod:`.cluster`), and the clean-up of the
Ray processes a killed run left behind (:mod:`.orphans`)."""
