"""Helpers shared by the test packages (``tests.unit``, ``tests.engine``, ``tests.distributed``,
``tests.gpu``): the plain-PyTorch reference trainer and the engine's configs (:mod:`.engine`),
random tensors and byte comparisons (:mod:`.tensors`), a tiered store over a real swapper
(:mod:`.store`), and the 2-rank gloo launcher (:mod:`.launch`)."""
