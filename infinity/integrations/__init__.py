"""The Hugging Face ways in: ``transformers.Trainer`` (:mod:`infinity.integrations.hf`),
``accelerate`` (:mod:`infinity.integrations.accelerate`) and peft adapters
(:mod:`infinity.integrations.peft`: save in peft's format, load a base checkpoint into a peft
model).

Optional: they need transformers, accelerate and peft (``pip install 'infinity[hf]'``). This
package imports none of them; each module raises an ImportError naming the extra when they are
missing. Above :mod:`infinity.zero` in the package DAG (they use only ``infinity.initialize``, the
engine's public parts and the config); nothing in the engine imports them.
"""
