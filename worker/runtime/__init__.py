"""The training runtime that runs inside each worker process.

Modules, imported one by one (this package imports nothing, so importing one of
them does not pull in the others):

- ``env``: the launcher's environment (``DistEnv``: torchrun's, else srun's, read
  by ``slurm``) and process-group set-up; ``local_launch`` starts a world on one
  machine with ``mp.spawn``, each child given torchrun's variables.
- ``devices``: the device the node agent placed a worker for (``RELAUNCH_DEVICE``)
  and ``DeviceShortage``, the start-up check that every local rank has a GPU.
- ``events``: ``EventWriter``, rank 0's JSON-lines channel to the node agent.
- ``snapshot``: ``TrainingState``, what a snapshot holds; its manifest, atomic save
  and newest verified load; ``storage`` where the files live (a directory or an
  fsspec URL); ``saver`` background writes; ``rng`` its RNG states;
  ``state_capture`` capture from and restore into a live run.
- ``sampler``: ``ResumableDistributedSampler``, resumable mid-epoch at any world size.
- ``model_prep``: seeding and model preparation (BatchNorm → SyncBatchNorm on CUDA).
- ``collectives``: snapshot agreement across ranks, loss averaging.
- ``config``: ``TrainerConfig``.
- ``startup``: the moments of the worker process's start, reported with its events.
- ``trainer``: ``Trainer``, the DDP training loop tying the above together.
"""
