"""Measuring one trial on one device: meters (cpu, cuda, fake), the trial itself, the strategies (what
one device holds: ddp, fsdp), memory policies (activation checkpointing), throughput timing, OOM
classification and the reserved-allocated gap (fragmentation).

Imports: torch, ``autotune.core`` and ``autotune.tasks``; never the search, the orchestration, the CLI.
"""
