"""The service image has no torch: the server must import, start and answer without it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import json, sys

    class NoTorch:
        # A meta path finder that makes torch (and anything under it) unimportable.
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test ({name})")
            return None

    sys.meta_path.insert(0, NoTorch())

    import warnings
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from fastapi.testclient import TestClient
    from autotune_server import Settings, create_app
    from autotune_server.migrate import upgrade_head

    url = "sqlite:///" + sys.argv[1]
    upgrade_head(url)
    app = create_app(Settings(database_url=url, api_tokens=("t",), access_log=False))
    body = json.loads(sys.argv[2])
    with TestClient(app) as client:
        up = client.post("/api/v1/profiles", json=body, headers={"Authorization": "Bearer t"})
        suggest = client.get(
            "/api/v1/suggest",
            params={
                "fingerprint": body["fingerprint"],
                "device_name": body["device"]["name"],
                "target_batch": 64,
            },
        )
    loaded = sorted(m for m in sys.modules if m == "autotune" or m.startswith("autotune."))
    print(json.dumps({
        "upload": up.status_code,
        "suggest": suggest.status_code,
        "torch_loaded": any(m == "torch" or m.startswith("torch.") for m in sys.modules),
        "autotune_modules": loaded,
    }))
    """
)


def test_server_runs_with_torch_unimportable(tmp_path: Path) -> None:
    from tests.factories import profile_payload

    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "store.db"), json.dumps(profile_payload())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["upload"] == 201
    assert result["suggest"] == 200
    assert result["torch_loaded"] is False
    # Of autotune, the server may use the torch-free floor only (autotune.core: the package rule), and of
    # it what it needs: the wire schemas, the plan arithmetic and the consistency check (with the errors it
    # raises), the throughput arithmetic and the memory surface.
    assert all(m in ("autotune", "autotune.core") or m.startswith("autotune.core.") for m in result["autotune_modules"])
    allowed = {
        "autotune",
        "autotune.core",
        "autotune.core.schemas",
        "autotune.core.split",
        "autotune.core.plan",
        "autotune.core.consistency",
        "autotune.core.errors",
        # The pricing of plans from timed runs (objective=throughput), torch-free like the plan.
        "autotune.core.recommend",
        # The peak surface over (m, L): /suggest predicts lengths nobody measured from it.
        "autotune.core.surface",
        # Bytes as people read them: the dashboard and the answers' notes write them as the CLI does.
        "autotune.core.units",
        # The memory policies' names: the grammar /suggest validates and the canonical spelling it matches.
        "autotune.core.policy_names",
        # The losses' names (--loss): the grammar /suggest validates lm_loss by and the canonical spelling it matches.
        "autotune.core.loss_names",
        # The job's mesh: /suggest plans over its data-parallel replicas and validates Profile.mesh with it.
        "autotune.core.mesh",
        # The job's setup (issue 40): the store answers a setup, and plans with it as the probe does.
        "autotune.core.setup",
        # The table of compositions (issue 61): /suggest refuses a setup the CLI refuses, in the CLI's words.
        "autotune.core.compositions",
    }
    assert set(result["autotune_modules"]) <= allowed
