"""What is probed: ``ProbeTask`` and ``path/file.py:name`` loading (``task``), ``hf:CONFIG`` specs
(``hf``), and the stable hash of everything that decides memory (``fingerprint``).

Imports: torch (lazily, for building models), transformers and peft only inside ``hf``'s builders, and
``autotune.core``; nothing above.
"""
