"""Drop-in tuners for the trainers people already use; each keeps the recipe's effective batch.

- :mod:`autotune_client.integrations.lightning`: ``AutotuneBatchSize``, a Lightning Callback that
  replaces ``BatchSizeFinder`` (needs the ``lightning`` extra);
- :mod:`autotune_client.integrations.transformers`: ``tune_trainer(trainer)``, for a Hugging Face
  ``Trainer`` before ``trainer.train()`` (needs the ``hf`` extra).

Both translate the trainer's world (its module or model, a batch from its data, its precision and
optimizer) into one :func:`autotune_client.suggest` call (the store, else a local probe; under a
process group rank 0 decides for every rank) and its answer back into the trainer's own settings:
the per-device batch size and the accumulation steps, so that micro-batch x accumulation x world
size stays the recipe's batch. This package imports neither framework; each module imports its own.
"""

__all__: list[str] = []
