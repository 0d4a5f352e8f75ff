"""The forkserver's last preload (tests/ranks.py): its heap, every module the preloads imported, frozen, so that each
process forked from it (a gloo rank, a forked ``autotune`` command) starts with those objects out of the collector's
reach, as autotune's own trials freeze theirs (autotune/core/heap.py): a collection in a rank walks what the rank made,
not the ~1,000,000 objects of torch, transformers and peft. Nothing alive here is any rank's garbage."""

import gc

gc.collect()
gc.freeze()
