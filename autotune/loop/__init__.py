"""The training-loop side: applying a plan correctly (``accumulate``: token-weighted normalization,
``no_sync``, one clip, a scheduler per update), feeding a plan's micro-batches (``plan_sampler``), proving
it on the user's model (``verify``), and length-aware batching over the memory surface (``sampler``).

Imports: torch, ``autotune.core``, ``autotune.tasks``; never the probe's measuring or search.
"""
