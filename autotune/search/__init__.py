"""Finding m_max: the search policy over a ``trial(m)`` callable (``boundary``), the fake-tensor
pre-search and its traced curve and surface (``presearch``), fake trials on worker processes
(``lanes``), and the diagnosis of a budget where nothing fits (``diagnose``).

Imports: ``autotune.measure``, ``autotune.tasks``, ``autotune.core``; never the orchestration or the CLI.
"""
