"""What is probed: ``ProbeTask`` and ``path/file.py:name`` loading (``task``), ``hf:CONFIG`` specs
(``hf``), the stable hash of everything that decides memory (``fingerprint``), and the one walker of the
nested batches a task makes (``batches``: the trial, the training loop and the client's local probe use it).

Imports: torch (lazily, for building models), transformers and peft only inside ``hf``'s builders, and
``autotune.core``; nothing above.
"""
