"""What both integrations share: the recipe's batch, the plan that keeps it, the precision names."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.core.schemas import Suggestion
from autotune_client.errors import AutotuneClientError

__all__ = ["IntegrationError", "TrainerLayout", "check_recipe", "describe", "equal_plan"]


class IntegrationError(AutotuneClientError):
    """The trainer's setup cannot be tuned as it is (one line: what is missing and where it looked)."""


@dataclass(frozen=True)
class TrainerLayout:
    """How a trainer's ranks hold the job, as suggest() takes it: every rank (``world_size``), the mesh's text
    (tensor and context parallel ranks are not replicas) and the strategy; ``replicas`` is D."""

    world_size: int
    strategy: str = "ddp"
    tp: int = 1
    cp: int = 1

    @property
    def mesh(self) -> str:
        parts = [f"{name}={degree}" for name, degree in (("tp", self.tp), ("cp", self.cp)) if degree > 1]
        return ",".join(parts)

    @property
    def replicas(self) -> int:
        """D: the ranks that each take their own share of the batch."""
        if self.world_size % (self.tp * self.cp):
            raise IntegrationError(
                f"the trainer's world size {self.world_size} is not a multiple of tp x cp = {self.tp} x {self.cp}"
            )
        return self.world_size // (self.tp * self.cp)


def check_recipe(recipe_batch: int, world_size: int) -> int:
    """The recipe's effective batch, refused unless every replica gets the same whole share."""
    if isinstance(recipe_batch, bool) or not isinstance(recipe_batch, int) or recipe_batch < 1:
        raise IntegrationError(f"target_batch must be a positive integer, got {recipe_batch!r}")
    if recipe_batch % world_size:
        raise IntegrationError(
            f"the recipe's batch {recipe_batch} is not a multiple of the world size {world_size}: "
            "every replica must train on the same number of samples per update"
        )
    return recipe_batch


def equal_plan(suggestion: Suggestion) -> tuple[int, int]:
    """(micro_batch, accumulation_steps) with equal micro-batches: what trainers can run."""
    micro, steps, _ = suggestion.equal_plan()
    return micro, steps


def describe(suggestion: Suggestion, micro: int, steps: int, recipe_batch: int) -> str:
    """One line for the log: the plan, whether it keeps the recipe, where the answer came from."""
    world = suggestion.world_size
    effective = micro * steps * world
    kept = "the recipe's batch" if effective == recipe_batch else f"NOT the recipe's {recipe_batch}"
    where = suggestion.source + (f", profile {suggestion.profile_id}" if suggestion.profile_id is not None else "")
    fits = f"largest fitting micro-batch {suggestion.max_micro_batch}"
    return (
        f"autotune: micro-batch {micro} x {steps} accumulation steps x {world} replicas = {effective} "
        f"({kept}); {fits} on {suggestion.device_name} ({where})"
    )
