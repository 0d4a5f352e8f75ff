"""TunerClient: the HTTP client of the profile store, with retries and typed errors.

    with TunerClient(base_url="http://tuner:8765") as tuner:
        suggestion = tuner.suggest(fingerprint=fp, target_batch=512, world_size=8, device_name="NVIDIA H100")

Every call is bounded by ``timeout`` in all (attempts, back-off and Retry-After waits together),
so a training job that asks the tuner before launch never hangs on it.
"""

from __future__ import annotations

import email.utils
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import httpx2 as httpx

from autotune.core.capacity import Capacity
from autotune.core.schemas import DeviceContext, Observation, Profile, Suggestion, SuggestQuery
from autotune_client._constants import (
    API_PREFIX,
    BUSY_ERROR_CODE,
    BUSY_RETRY_JITTER_FRACTION,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_SECONDS,
    ENV_TOKEN,
    ENV_URL,
    INITIAL_RETRY_DELAY_SECONDS,
    MAX_RETRY_AFTER_SECONDS,
    MAX_RETRY_DELAY_SECONDS,
    NON_RETRYABLE_STATUS_CODES,
    PAGE_SIZE,
    RETRY_AFTER_JITTER_FRACTION,
    RETRY_JITTER_FRACTION,
    RETRYABLE_STATUS_CODES,
    USER_AGENT,
)
from autotune_client._models import ProfileSummary, StoredProfile
from autotune_client.errors import (
    APIConnectionError,
    APITimeoutError,
    AutotuneClientError,
    NotFoundError,
    status_error,
)

__all__ = ["TunerClient"]


def _parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None when absent or odd."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        parsed = email.utils.parsedate_tz(value)
        if parsed is None:
            return None
        seconds = email.utils.mktime_tz(parsed) - time.time()
    if not math.isfinite(seconds):
        return None
    return max(seconds, 0.0)


def _normalise_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise AutotuneClientError(f"tuner URL {url!r} must start with http:// or https://")
    # Accept both the server root and the API root, since both get pasted into AUTOTUNE_URL.
    if url.endswith(API_PREFIX):
        url = url[: -len(API_PREFIX)]
    return url


class TunerClient:
    """Client of an autotune server's REST API.

    Args:
        base_url: the server root, e.g. ``http://tuner:8765``; defaults to ``$AUTOTUNE_URL``.
        token: bearer token sent with every request; defaults to ``$AUTOTUNE_TOKEN`` (writes need one).
        timeout: seconds one call may take in all, retries and back-off included.
        max_retries: retries after the first attempt on connection errors, 408, 429 and 5xx; a 503
            ``server_busy`` (a saturated server: nothing done) is retried after its Retry-After
            while ``timeout`` allows, beyond this count (not when it is 0).
        http_client: an ``httpx.Client`` to use (tests pass one with a MockTransport); it is not
            closed by this client.

    Raises:
        AutotuneClientError: no URL given and ``$AUTOTUNE_URL`` unset, a URL without a scheme,
            or a non-positive timeout.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.Client | None = None,
    ) -> None:
        url = base_url or os.environ.get(ENV_URL, "")
        if not url.strip():
            raise AutotuneClientError(f"no tuner server: pass base_url= or set {ENV_URL}")
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            raise AutotuneClientError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise AutotuneClientError(f"max_retries must be a non-negative integer, got {max_retries!r}")
        self.base_url = _normalise_base_url(url)
        self.token = token if token is not None else (os.environ.get(ENV_TOKEN) or None)
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.Client(timeout=self.timeout)
        # Seams for the retry tests: waiting and jitter without real sleeping or randomness.
        self._sleep: Callable[[float], None] = time.sleep
        self._random: Callable[[], float] = random.random

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool (only when this client created it)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> TunerClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TunerClient(base_url={self.base_url!r}, timeout={self.timeout:g}, "
            f"max_retries={self.max_retries})"
        )

    # -- the API ---------------------------------------------------------------------------------

    def profiles(self, **filters: Any) -> list[ProfileSummary]:
        """Stored profiles, newest upload first, following the server's pagination to the end.

        Args:
            **filters: the server's filters: ``fingerprint``, ``task``, ``device_name``,
                ``precision``, ``strategy``, ``world_size``, ``source``; ``limit`` caps how many are
                returned in all.

        Returns:
            One summary per profile (ids and lookup columns; ``profile(id)`` has the trials).
        """
        limit = filters.pop("limit", None)
        params = {k: v for k, v in filters.items() if v is not None}
        out: list[ProfileSummary] = []
        cursor: str | None = None
        while True:
            page_params = dict(params)
            if cursor:
                page_params["cursor"] = cursor
            page_params["limit"] = min(PAGE_SIZE, limit - len(out)) if limit is not None else PAGE_SIZE
            data = self._request("GET", "/profiles", params=page_params).json()
            if not isinstance(data, dict) or not isinstance(data.get("items"), list):
                raise AutotuneClientError("GET /profiles: the server's answer has no items")
            out.extend(ProfileSummary.model_validate(item) for item in data["items"])
            cursor = data.get("next_cursor")
            if not cursor or not data["items"] or (limit is not None and len(out) >= limit):
                return out

    def profile(self, profile_id: int) -> StoredProfile:
        """One stored profile with its trials. Raises NotFoundError for an unknown id."""
        return StoredProfile.model_validate(self._request("GET", f"/profiles/{int(profile_id)}").json())

    def upload(self, profile: Profile) -> int:
        """Store a profile and return its id.

        Idempotent: the server keys profiles by content, so the same profile twice (a retry, or two
        jobs that probed the same setup) gives the same id; that is also why a POST is retried.

        Raises:
            AuthenticationError / PermissionDeniedError: no token, or one the server refuses.
            UnprocessableEntityError: the server rejected a field.
        """
        response = self._request("POST", "/profiles", json=profile.model_dump(mode="json"))
        return _id_of(response)

    def device_context(self, device_name: str, *, torch_version: str | None = None) -> DeviceContext | None:
        """What the store has measured of device_name's memory outside the caching allocator (the CUDA
        context and modules) over measured CUDA profiles, optionally of one torch (major.minor); None
        where nothing is measured. ``autotune estimate --gpu NAME --server URL`` adds it to reserved bytes.
        """
        params = {"device_name": device_name} | ({"torch_version": torch_version} if torch_version else {})
        try:
            response = self._request("GET", "/devices/context", params=params)
        except NotFoundError:
            return None
        return DeviceContext.model_validate(response.json())

    def delete(self, profile_id: int) -> None:
        """Delete a stored profile (write token). Raises NotFoundError for an unknown id."""
        self._request("DELETE", f"/profiles/{int(profile_id)}")

    def suggest(
        self,
        *,
        fingerprint: str,
        target_batch: int | None,
        world_size: int,
        device_name: str,
        budget_bytes: int | None = None,
        headroom: float | None = None,
        strategy: str = "ddp",
        plan: str = "balanced",
        activation_checkpointing: str = "none",
        objective: str = "memory",
        seq_len: int | None = None,
        target_tokens: int | None = None,
        mesh: str = "",
        host_budget_bytes: int | None = None,
        offload: str | None = None,
        compile: str | None = None,
        lm_loss: str | None = None,
    ) -> Suggestion:
        """The plan for a job from what the store knows.

        Args:
            strategy: "ddp" (every rank holds the whole model) or "fsdp" (sharded over
                ``world_size`` ranks: one rank's memory depends on it, so the store matches it).
            plan: "balanced" (the fewest steps; micro-batches within one of each other, listed in
                ``micro_batches``) or "divisor" (equal micro-batches).
            activation_checkpointing: the job's memory policy ("none", "every-K", "full", "op", ...); with
                ``objective="memory"`` only profiles measured under it answer.
            objective: "memory" (default) or "throughput": the stored policy whose plan was timed
                fastest answers, and ``Suggestion.activation_checkpointing`` says which the job needs.
            seq_len: a sequence-aware job's length: the profile at it answers, else the memory
                surface that covers it (``predicted``); the answer is in tokens too.
            target_tokens: tokens per update instead of ``target_batch`` (None), with ``seq_len``.
            mesh: the job's mesh as ``Mesh.label`` writes it (``"tp=2"``; '' for none): ``world_size`` then
                counts every rank and the plan is over world_size / (tp x pp x cp) replicas; the fingerprint
                must be the mesh's (``task_fingerprint(task, mesh=...)``).
            host_budget_bytes: the host memory an offloading job may use: profiles measured within it answer.
            offload, compile, lm_loss: the job's offload, torch.compile mode and loss (plain, chunked:N,
                fused-linear; None: the fingerprint's); a profile of another setup in any of these (or the mesh) is a
                422 naming the field (autotune/core/setup.py).

        Returns:
            A Suggestion with ``source`` "measured" (a profile of this kind of job on this device
            model), "predicted" (from another device model's fit given ``budget_bytes``, or from an
            fsdp profile at another world size or a ddp one), or "estimated" (fake-tensor trials
            only); ``warnings`` say what was not measured.

        Raises:
            NotFoundError: nothing stored matches; the message says what was looked for.
            UnprocessableEntityError: e.g. target_batch < world_size, or an unknown strategy.
            AutotuneClientError: an fsdp job asked a server that does not know strategies.
        """
        # The keywords are SuggestQuery's fields; the server validates them (a bad one is its 422, as ever).
        return self._suggest_query(SuggestQuery.model_construct(**{k: v for k, v in locals().items() if k != "self"}))

    def _suggest_query(self, query: SuggestQuery) -> Suggestion:
        """GET /suggest with ``query`` (``suggest``'s keywords as the model; ``autotune_client.suggest`` builds
        it too)."""
        body = self._request("GET", "/suggest", params=_suggest_params(query)).json()
        if not isinstance(body, dict):
            raise AutotuneClientError(f"the server answered /suggest with {type(body).__name__}, not an object")
        # A newer server may add fields: an older client keeps what it knows instead of failing.
        known = {key: value for key, value in body.items() if key in Suggestion.model_fields}
        if body.get("strategy", "ddp") != query.strategy:
            # A server from before strategies ignores the parameter and would answer an fsdp job
            # from a ddp profile as if it were measured.
            raise AutotuneClientError(
                f"the server answered /suggest for strategy {body.get('strategy', 'ddp')!r}, not {query.strategy!r}: "
                "upgrade it to one that knows strategies"
            )
        return Suggestion.model_validate(known)

    def capacity(
        self,
        *,
        fingerprint: str,
        device_name: str,
        strategy: str = "ddp",
        world_size: int = 1,
        activation_checkpointing: str = "none",
        source: str | None = None,
    ) -> Capacity:
        """m_max at every sequence length, from the newest stored run over lengths of this setup on
        device_name (``autotune_client._capacity``): a callable ``L -> m_max(L)`` for
        ``autotune.loop.sampler.LengthBatchSampler``, as ``autotune.core.capacity.capacity`` builds
        it from local profiles.

        Raises:
            AutotuneClientError: nothing stored over lengths for this setup, or profiles that make no capacity.
        """
        from autotune_client._capacity import stored_capacity

        return stored_capacity(
            self,
            fingerprint=fingerprint,
            device_name=device_name,
            strategy=strategy,
            world_size=world_size,
            activation_checkpointing=activation_checkpointing,
            source=source,
        )

    def observe(self, profile_id: int, observation: Observation) -> int | None:
        """Report what a job really saw at some micro-batch (a peak, or an OOM). Returns the id stored.

        Not idempotent, so only failures where the server surely did not get the request are retried.
        """
        response = self._request(
            "POST",
            f"/profiles/{int(profile_id)}/observations",
            # Only what the job set: a world size or device left out is not checked against the profile's.
            json=observation.model_dump(mode="json", exclude_unset=True),
            idempotent=False,
        )
        try:
            return _id_of(response)
        except AutotuneClientError:
            return None

    def observer(self, profile_id: int) -> Callable[[Observation], None]:
        """A callback for ``Accumulator(observe=...)``: posts each observation to profile_id.

        A tuner that is down must not stop training: a failed post becomes a warning.

            acc = Accumulator(model, opt, accumulation_steps=A, oom_fallback=True, target_batch=T,
                              observe=client.observer(suggestion.profile_id))
        """

        def post(observation: Observation) -> None:
            try:
                self.observe(profile_id, observation)
            except AutotuneClientError as exc:
                warnings.warn(f"could not report the observation to the tuner: {exc}", stacklevel=2)

        return post

    def healthy(self) -> bool:
        """Whether /healthz answers 200 (one attempt, no retries)."""
        try:
            response = self._http.get(f"{self.base_url}/healthz", timeout=self.timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    # -- transport -------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _retry_delay(
        self, attempt: int, response: httpx.Response | None, remaining: float = math.inf, *, busy: bool = False
    ) -> float:
        """Seconds to wait before the next attempt: the server's Retry-After when it gave a believable
        one (lengthened by jitter only while that still fits in ``remaining``; more jitter when the
        server was busy), else the back-off."""
        if response is not None:
            retry_after = _parse_retry_after(response.headers.get("Retry-After"))
            if retry_after is not None and retry_after <= MAX_RETRY_AFTER_SECONDS:
                fraction = BUSY_RETRY_JITTER_FRACTION if busy else RETRY_AFTER_JITTER_FRACTION
                jittered = retry_after * (1.0 + fraction * self._random())
                return jittered if jittered < remaining else retry_after
        delay = min(MAX_RETRY_DELAY_SECONDS, INITIAL_RETRY_DELAY_SECONDS * 2**attempt)
        return delay * (1.0 - RETRY_JITTER_FRACTION * self._random())

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        idempotent: bool = True,
    ) -> httpx.Response:
        url = f"{self.base_url}{API_PREFIX}{path}"
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APITimeoutError(f"{method} {url}: no answer within {self.timeout:g} s")
            response: httpx.Response | None = None
            error: AutotuneClientError
            busy = False
            try:
                response = self._http.request(
                    method, url, params=params, json=json, headers=self._headers(), timeout=remaining
                )
            except httpx.TimeoutException as exc:
                error = APITimeoutError(f"{method} {url}: no answer within {self.timeout:g} s")
                error.__cause__ = exc
                # A connect timeout never reached the server; a read timeout may have.
                retryable = idempotent or isinstance(exc, httpx.ConnectTimeout)
            except httpx.UnsupportedProtocol as exc:
                raise APIConnectionError(f"{method} {url}: {exc}") from exc
            except httpx.TransportError as exc:
                reason = str(exc) or type(exc).__name__
                error = APIConnectionError(f"cannot reach the tuner at {self.base_url}: {reason}")
                error.__cause__ = exc
                retryable = idempotent or isinstance(exc, httpx.ConnectError)
            else:
                if response.is_success:
                    return response
                error = status_error(response)
                status = response.status_code
                retryable = status in RETRYABLE_STATUS_CODES or (
                    status >= 500 and idempotent and status not in NON_RETRYABLE_STATUS_CODES
                )
                # 503 means the server did not process it, whatever the method.
                retryable = retryable or status == 503
                busy = status == 503 and getattr(error, "code", None) == BUSY_ERROR_CODE
            # A busy server asks for a short wait and did nothing: retried while the call's timeout
            # allows, not counted against max_retries (a crowd may be shed more than twice in a row).
            out_of_retries = attempt >= self.max_retries and not (busy and self.max_retries > 0)
            if not retryable or out_of_retries:
                raise error
            delay = self._retry_delay(attempt, response, deadline - time.monotonic(), busy=busy)
            if time.monotonic() + delay >= deadline:
                # Waiting would overrun the call's timeout: fail now with what the server said.
                raise error
            self._sleep(delay)
            attempt += 1


def _id_of(response: httpx.Response) -> int:
    try:
        data = response.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("id"), int):
        return int(data["id"])
    location = response.headers.get("Location", "")
    tail = location.rstrip("/").rsplit("/", 1)[-1]
    if tail.isdigit():
        return int(tail)
    raise AutotuneClientError(
        f"{response.request.method} {response.request.url.path}: the server's answer carries no id"
    )


def _suggest_params(query: SuggestQuery) -> dict[str, Any]:
    """The query string of GET /suggest: world_size always (every server reads it), the required fields, and
    every other field only away from its default, so that a server from before that field (strategies,
    balanced plans, memory policies, objectives, lengths) answers as it always did."""
    return {"world_size": query.world_size} | query.model_dump(exclude_defaults=True, warnings=False)
