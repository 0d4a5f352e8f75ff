"""autotune_client: ask the profile store for a job's micro-batch plan, or probe and fill it.

    from autotune_client import suggest

    s = suggest(model, target_batch=512, example=batch)   # $AUTOTUNE_URL names the server
    s.micro_batch, s.accumulation_steps                   # m and A with m x A x world_size = 512

:class:`TunerClient` is the REST client beneath it (retries, typed errors: see
:mod:`autotune_client.errors`). Importing this package does not import torch; ``suggest`` imports it,
and the probe, only when it runs.
"""

from autotune.core.schemas import Observation, Profile, Suggestion
from autotune_client._client import TunerClient
from autotune_client._models import ProfileSummary, StoredProfile
from autotune_client._observer import PeakObserver, observer
from autotune_client._suggest import job_fingerprint, parse_bytes, suggest
from autotune_client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    AutotuneClientError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    TunerUnavailableWarning,
    UnprocessableEntityError,
)

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "AutotuneClientError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "Observation",
    "PeakObserver",
    "PermissionDeniedError",
    "Profile",
    "ProfileSummary",
    "RateLimitError",
    "StoredProfile",
    "Suggestion",
    "TunerClient",
    "TunerUnavailableWarning",
    "UnprocessableEntityError",
    "job_fingerprint",
    "observer",
    "parse_bytes",
    "suggest",
]
