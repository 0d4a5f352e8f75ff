"""The torch-free floor: what the server, the client and every other package of autotune may import.

Wire schemas (``schemas``), byte units (``units``), plan arithmetic (``plan``, ``split``), the checks a
profile must pass (``consistency``), the peak curve and surface read off traced trials (``curve``,
``surface``), recommendation rules (``recommend``), the errors every command turns into one line
(``errors``), atomic writes (``files``), the model of the CUDA caching allocator (``allocator``) and the
CUDA kernels' own temporaries it replays (``kernel_temporaries``), the card catalog (``cards``) and the
capacity over lengths (``capacity``).

Imports: the standard library and pydantic only; never torch, never another package of autotune
(a test keeps it so). The service image has no torch: this floor is all it gets.
"""
