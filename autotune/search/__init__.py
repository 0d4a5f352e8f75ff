"""Finding m_max: the search policy over a ``trial(m)`` callable (``boundary``), the fake-tensor
pre-search and its traced curve and surface (``presearch``), fake trials on worker processes
(``lanes``), the diagnosis of a budget where nothing fits (``diagnose``), the search on a card's figure
(``reserved``) and its depth shortcut, a deep model's trials made from walks of a few of its blocks (``depth``,
``depth_template``, ``depth_walks``, ``depth_figures``).

Imports: ``autotune.measure``, ``autotune.tasks``, ``autotune.core``; never the orchestration or the CLI.
"""
