"""--ep over 4 real gloo ranks (issue 63): ep 2 under fsdp 4, so each expert is shared by 2 ranks (efsdp 2: FSDP2
shards the experts too), and ep 4 (every rank its own experts); the truth is tests/autotune/_ep_worker.py, as in
test_experts.py (apart so that each file runs within a minute)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.measure.meters.fake import FakeMeter
from tests.autotune.test_experts import LIMIT_BYTES, PROBE_HOLDS_BYTES_PER_RANK, _mixtral, _probe, _truth

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")


def test_ep_2_over_4_ranks_skewed_rank_0_is_the_most_loaded(tmp_path: Path) -> None:
    """Expert 0 takes twice its fair share: ranks 0 and 2 hold experts 0-3, ranks 1 and 3 the others, less."""
    task = _mixtral(tmp_path)
    probed = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 4, 2, (2,), 2.0)
    truth = _truth(tmp_path, 4, 2, (2,), 0.5)
    print(f"ep 2 x fsdp 4, skewed: probe {probed}, real ranks {truth}")
    assert truth[2][0] == truth[2][2] == max(truth[2]) > truth[2][1] == truth[2][3]
    assert probed[2] - truth[2][0] == 4 * PROBE_HOLDS_BYTES_PER_RANK


def test_ep_4_over_4_ranks_balanced(tmp_path: Path) -> None:
    task = _mixtral(tmp_path)
    probed = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 4, 4, (1, 2), 1.0)
    truth = _truth(tmp_path, 4, 4, (1, 2), None)
    print(f"ep 4 x fsdp 4, balanced: probe {probed}, real ranks {truth}")
    for m in (1, 2):
        assert len(set(truth[m])) == 1
        assert probed[m] - truth[m][0] == 4 * PROBE_HOLDS_BYTES_PER_RANK
