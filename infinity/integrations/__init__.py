"""Ways in from the Hugging Face stack (optional extras): :mod:`.peft` (adapters: save in peft's
format, load a base checkpoint into a peft model). Each module imports its library on use and
raises an ImportError naming the extra when it is missing."""
