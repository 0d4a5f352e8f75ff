"""The setup dimension of /suggest: which stored profiles were measured under the job's own setup.

A profile answers only a query of its own setup (autotune/core/setup.py) in the fields that change what a
device holds or the plan's D and that no prediction covers: the mesh (its degrees and pipeline schedule; a
query that leaves out the pipeline's K takes the profile's), the host budget (a host-capped profile and an
uncapped one share a fingerprint), the offload, the compile mode and the loss (in the fingerprint too: a query
that leaves them out takes the profile's). Where the fingerprint has profiles but none of the query's setup, the
answer is a 422 naming the field and listing the stored setups, never a plan over another D. The strategy and the
world size are ``suggest._rank``'s: those it predicts across, and says so.
"""

from __future__ import annotations

from dataclasses import replace

from autotune.core.loss_names import PLAIN_LOSS
from autotune.core.mesh import Mesh
from autotune.core.schemas import SuggestQuery
from autotune.core.setup import JobSetup
from autotune_server.candidates import Candidate, Lookup
from autotune_server.errors import SetupMismatch

__all__ = ["for_setup", "mismatch"]


def _same_mesh(stored: Mesh, asked: Mesh) -> bool:
    if asked.pp_microbatches is None:  # K unsaid: the profile's K bounds the plan
        stored = replace(stored, pp_microbatches=None)
    return stored == asked


def mismatch(c: Candidate, query: SuggestQuery) -> str | None:
    """The first field (a /suggest parameter) in which c's setup differs from the query's, None if none."""
    stored, asked = c.setup, JobSetup.of_query(query)
    if not _same_mesh(stored.mesh, asked.mesh):
        return "mesh"
    if asked.offload is not None and asked.offload != stored.offload:
        return "offload"
    if asked.host_budget_bytes != stored.host_budget_bytes:
        return "host_budget_bytes"
    if asked.compile is not None and asked.compile != stored.compile:
        return "compile"
    if asked.lm_loss is not None and asked.lm_loss != (stored.lm_loss or PLAIN_LOSS):
        return "lm_loss"
    return None


def _said(setup: JobSetup, field: str) -> str:
    if field == "mesh":
        return f"mesh={setup.mesh.label() or '(none)'}"
    if field == "host_budget_bytes":
        return f"host_budget_bytes={setup.host_budget_bytes}" if setup.host_budget_bytes else "no host budget"
    return f"{field}={getattr(setup, field) or 'none'}"


def for_setup(found: Lookup, query: SuggestQuery) -> Lookup:
    """The lookup restricted to the profiles of the query's setup.

    Raises:
        SetupMismatch: the fingerprint has profiles, none of the query's setup.
    """
    everyone = (*found.here, *found.elsewhere)
    if not everyone:
        return found
    kept = {c.id for c in everyone if mismatch(c, query) is None}
    if kept:
        return Lookup(
            here=tuple(c for c in found.here if c.id in kept),
            elsewhere=tuple(c for c in found.elsewhere if c.id in kept),
            skipped=found.skipped,
        )
    newest = everyone[0]
    field = mismatch(newest, query) or "fingerprint"
    stored = sorted({_said(c.setup, field) for c in everyone if mismatch(c, query) == field})
    asked = _said(JobSetup.of_query(query), field)
    raise SetupMismatch(
        f"{field}: the job asks {asked}, and every profile of fingerprint {query.fingerprint} was measured under "
        f"another setup ({', '.join(stored)}): ask with the job's own {field}, or probe this setup",
        field=field,
        details={"asked": asked, "stored": stored},
    )
