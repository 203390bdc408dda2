"""Built-in training tasks, each a module runnable under torchrun unchanged.

Their names and parameters are in ``contract.tasks``, which imports no torch
(the controller validates job specs with it); the task modules themselves
(``regression``, ``spirals``, ``charlm``) import torch. This package imports
nothing.
"""
