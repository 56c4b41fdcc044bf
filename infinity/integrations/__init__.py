"""The Hugging Face ways in: ``transformers.Trainer`` (:mod:`infinity.integrations.hf`) and
``accelerate`` (:mod:`infinity.integrations.accelerate`).

Optional: they need transformers and accelerate (``pip install 'infinity[hf]'``, which brings peft
too for adapter checkpoints). This package imports neither; each module raises an ImportError
naming the extra when they are missing. Above :mod:`infinity.zero` in the package DAG (they use
only ``infinity.initialize`` and the config); nothing in the engine imports them.
"""
