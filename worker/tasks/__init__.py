"""Built-in training tasks, each a module runnable under torchrun unchanged.

``registry`` is importable without torch (the controller validates job specs
with it); the task modules themselves (``regression``, ``spirals``, ``charlm``)
import torch. This package imports nothing.
"""
