"""--sdpa-backend: the attention kernel a job's scaled_dot_product_attention runs, forced in the trials, named on the
datasheet (and, without the flag, the kernel torch picked there), and part of the fingerprint.

The truth on the CPU: the tiny Llama trained by the ordinary loop (tests/autotune/_allocator_truth.py) inside torch's
own ``sdpa_kernel(SDPBackend.MATH)`` (or with torch's own pick), counted by the CPU allocator: the probe's m_max and
its figures at m_max and m_max + 1 are the allocator's. On an emulated card the math path holds the attention matrix
the fused kernels do not."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.errors import TaskError
from autotune.core.schemas import Profile
from autotune.orchestrate.config import ProbeConfig
from autotune.orchestrate.probe import probe
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.hf import hf_task
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._hf_configs import write_config

pytest.importorskip("transformers")

SEQ_LEN = 32
# Between m_max and m_max + 1 of each: flash on the CPU 1,065,852 / 1,317,884 at m 2 / 3; math 853,756 / 1,145,724
# at m 1 / 2.
BUDGETS = {None: 1_100_000, "math": 1_100_000}


def _ordinary(backend: str | None) -> contextlib.AbstractContextManager[object]:
    """The truth's own choice of kernel: torch's sdpa_kernel around the ordinary loop (or torch's own pick)."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


@pytest.mark.parametrize("backend", [None, "math"])
def test_the_probe_equals_the_allocator_under_the_kernel_asked_for(tmp_path: Path, backend: str | None) -> None:
    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    config = ProbeConfig(device="cpu", budget_bytes=BUDGETS[backend], headroom=0.0, sdpa_backend=backend)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake and not t.oom}
    with _ordinary(backend):
        truth = {m: allocator_peak_bytes(task, m) for m in (m_max, m_max + 1)}
    print(f"--sdpa-backend {backend}: m_max {m_max}, probe {peaks}, allocator {truth}")
    assert truth[m_max] <= measured.limit_bytes < truth[m_max + 1]
    assert peaks[m_max] == truth[m_max]
    if m_max + 1 in peaks:
        assert peaks[m_max + 1] == truth[m_max + 1]
    lines = [w for w in measured.warnings if w.startswith("attention: ")]
    assert len(lines) == 1
    expected = "math path of scaled_dot_product_attention (--sdpa-backend math)" if backend else "flash (CPU) kernel"
    assert expected in lines[0] and (backend is not None or "torch's pick" in lines[0])


def test_the_kernel_enters_the_fingerprint_and_a_kernel_torch_lacks_is_one_line(tmp_path: Path) -> None:
    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    math = dataclasses.replace(task, sdpa_backend="math")
    assert task_fingerprint(task) != task_fingerprint(math) and math.tags["sdpa_backend"] == "math"
    assert task.job_setup().sdpa_backend is None and math.job_setup().sdpa_backend == "math"
    assert task.with_setup(math.job_setup()).sdpa_backend == "math"
    with pytest.raises(TaskError, match="not an attention kernel"):
        dataclasses.replace(task, sdpa_backend="xformers")
    # The CPU has no memory-efficient kernel: the first trial says so in one line, naming the flag.
    with pytest.raises(TaskError, match=r"^--sdpa-backend efficient: scaled_dot_product_attention has no efficient"):
        probe(dataclasses.replace(task, sdpa_backend="efficient"), ProbeConfig(device="cpu", budget_bytes=1 << 20))


def test_on_an_emulated_card_the_math_path_holds_more_and_each_kernel_is_named(
    cuda_python: str, tmp_path: Path
) -> None:
    folder = write_config(tmp_path, "llama", num_key_value_heads=4, max_position_embeddings=256)  # no grouped heads
    figures: dict[str, int] = {}
    lines: dict[str, str] = {}
    for backend in ("default", "flash", "efficient", "math"):
        out = tmp_path / f"{backend}.json"
        flags = [] if backend == "default" else ["--sdpa-backend", backend]
        code = main(
            ["estimate", f"hf:{folder}", "--gpu", "h100", "--precision", "bf16", "--seq-len", "256",
             "--max-micro-batch", "8", "--micro-batches", "8", "--output", str(out), *flags]
        )  # fmt: skip
        assert code == 0, backend
        (raw,) = json.loads(out.read_text())
        profile = Profile.model_validate(raw)
        figures[backend] = next(t.peak_bytes for t in profile.trials if t.micro_batch == 8)
        (lines[backend],) = [w for w in profile.warnings if w.startswith("attention: ")]
    print(figures, lines)
    assert lines["flash"] == "attention: flash kernel of scaled_dot_product_attention (--sdpa-backend flash)"
    assert "memory-efficient kernel of scaled_dot_product_attention (--sdpa-backend efficient)" in lines["efficient"]
    assert "math path" in lines["math"] and "torch's pick" in lines["default"]
    # The math path keeps the (m, heads, L, L) attention weights for its backward; the fused kernels do not.
    assert figures["math"] > max(figures["flash"], figures["efficient"], figures["default"])
