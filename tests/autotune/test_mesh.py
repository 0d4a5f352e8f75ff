"""The mesh (autotune/core/mesh.py): D = W / (tp x pp x cp), its refusals, the pipeline's bubble."""

from __future__ import annotations

import doctest

import pytest

import autotune.core.mesh as mesh_module
from autotune.core.errors import AutotuneError, ExitCode, exit_code_for
from autotune.core.mesh import Mesh


def test_the_doctests_hold() -> None:
    failures, tried = doctest.testmod(mesh_module)
    assert tried > 0 and failures == 0


@pytest.mark.parametrize(
    ("mesh", "world_size", "replicas"),
    [(Mesh(), 8, 8), (Mesh(tp=2), 8, 4), (Mesh(tp=2, pp=2), 8, 2), (Mesh(tp=2, pp=2, cp=2), 8, 1), (Mesh(tp=8), 8, 1)],
)
def test_data_parallel_is_the_world_over_the_model_parallel_ranks(mesh: Mesh, world_size: int, replicas: int) -> None:
    assert mesh.data_parallel(world_size) == replicas
    assert mesh.data_parallel(world_size) * mesh.model_parallel == world_size


def test_the_bubble_is_pp_minus_one_over_k_plus_pp_minus_one() -> None:
    assert Mesh().bubble_fraction() == 0.0
    assert Mesh(pp=4, pp_microbatches=4).bubble_fraction() == pytest.approx(3 / 7)
    assert Mesh(pp=4).bubble_fraction(16) == pytest.approx(3 / 19)
    # Interleaving V chunks per rank shrinks the bubble V-fold relative to the work: (pp - 1) / (V K + pp - 1).
    interleaved = Mesh(pp=4, pp_schedule="interleaved-1f1b", pp_virtual_stages=2, pp_microbatches=8)
    assert interleaved.bubble_fraction() == pytest.approx(3 / 19)
    with pytest.raises(AutotuneError, match="--pp-microbatches"):
        Mesh(pp=2).bubble_fraction()


@pytest.mark.parametrize(
    ("mesh", "world_size", "flag"),
    [
        (Mesh(tp=3), 8, "--world-size 8 is not a multiple of --tp x --pp x --cp"),
        (Mesh(tp=2, pp=2), 6, "--world-size 6 is not a multiple"),
        (Mesh(tp=0), 8, "--tp must be a positive integer"),
        (Mesh(cp=-1), 8, "--cp must be a positive integer"),
        (Mesh(pp=4, pp_microbatches=2), 8, "--pp-microbatches 2 is below --pp 4"),
        (Mesh(pp=2, pp_schedule="zigzag"), 8, "--pp-schedule must be one of 1f1b, gpipe, interleaved-1f1b"),  # type: ignore[arg-type]
        (Mesh(pp=2, pp_virtual_stages=2), 8, "--pp-virtual-stages 2 applies to --pp-schedule interleaved-1f1b"),
        (Mesh(pp_microbatches=4), 8, "--pp-microbatches 4 needs --pp of at least 2"),
        (Mesh(pp_schedule="gpipe"), 8, "--pp-schedule gpipe needs --pp of at least 2"),
    ],
)
def test_a_mesh_no_job_runs_is_refused_in_one_line_as_a_usage_error(mesh: Mesh, world_size: int, flag: str) -> None:
    with pytest.raises(AutotuneError) as caught:
        mesh.data_parallel(world_size)
    message = str(caught.value)
    assert message.startswith(flag) and "\n" not in message
    assert exit_code_for(caught.value) == ExitCode.USAGE


def test_gpipe_runs_fewer_micro_batches_than_stages() -> None:
    assert Mesh(pp=4, pp_schedule="gpipe", pp_microbatches=2).data_parallel(8) == 2


def test_the_trivial_mesh_records_nothing_and_every_mesh_round_trips() -> None:
    assert Mesh().as_dict() == {} and Mesh.from_dict({}) == Mesh() and Mesh.from_dict(None) == Mesh()
    for mesh in (
        Mesh(tp=2),
        Mesh(tp=2, pp=4, pp_schedule="gpipe", pp_microbatches=3),
        Mesh(pp=2, cp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=3, pp_microbatches=4),
    ):
        assert Mesh.from_dict(mesh.as_dict()) == mesh
    assert Mesh(tp=2).describe() == "tp 2"
    assert Mesh.from_dict({"ep": 2}) == Mesh(ep=2) and not Mesh(ep=2).trivial
    assert Mesh.parse(Mesh(ep=2).label()) == Mesh(ep=2) and Mesh(ep=2).data_parallel(4) == 4
    dropping = Mesh(ep=2, ep_capacity=1.25)
    assert Mesh.from_dict(dropping.as_dict()) == dropping == Mesh.parse(dropping.label())
    assert dropping.describe() == "ep 2 (capacity factor 1.25)" and Mesh(ep=2).describe() == "ep 2 (dropless)"
    with pytest.raises(AutotuneError, match="--moe-capacity-factor 1.25 needs --ep"):
        Mesh(ep_capacity=1.25).validate()
    with pytest.raises(AutotuneError, match="--moe-capacity-factor 0 is not a positive"):
        Mesh(ep=2, ep_capacity=0.0).validate()
    assert Mesh(tp=2, pp=2, pp_microbatches=8).describe() == "tp 2 x pp 2 (1f1b, K 8)"
    with pytest.raises(AutotuneError, match="unknown field"):
        Mesh.from_dict({"sp": 2})


def test_the_label_reads_back_and_the_trivial_mesh_is_the_empty_label() -> None:
    assert Mesh().label() == "" and Mesh.parse("") == Mesh()
    mesh = Mesh(tp=2, pp=2, pp_schedule="gpipe", pp_microbatches=4)
    assert mesh.label() == "tp=2,pp=2,pp_schedule=gpipe,pp_microbatches=4"
    assert Mesh.parse(mesh.label()) == mesh
    with pytest.raises(AutotuneError, match="not KEY=VALUE"):
        Mesh.parse("tp2")
    with pytest.raises(AutotuneError, match="not an integer"):
        Mesh.parse("tp=two")


def test_the_datasheet_says_the_mesh_and_the_replicas() -> None:
    from autotune.cli.report import strategy_text
    from tests.factories import make_profile

    profile = make_profile(world_size=8, strategy="fsdp").model_copy(update={"mesh": {"tp": 2}})
    assert strategy_text(profile) == (
        "fsdp over 4 data-parallel replicas of 8 ranks, tp 2 (the figures are rank 0's, for this mesh only)"
    )
