"""Orchestration: device(s) -> search -> plan -> Profile. ``probe`` (real trials confirmed after a fake
pre-search), ``estimate`` (fake trials only: answers without the device), ``lengths`` (one run over
several sequence lengths, the surface), ``multi`` (one process per visible GPU).

Imports: every floor below (``search``, ``measure``, ``tasks``, ``loop``, ``core``); only the CLI and the
fleet import it.
"""
