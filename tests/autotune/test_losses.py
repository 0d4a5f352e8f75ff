"""--loss: the loss as the job computes it (autotune/tasks/losses.py): TRL's chunked NLL and Liger's fused linear
cross entropy, in the trials, the setup, the fingerprint and the store.

The truth on the CPU: the tiny Llama built the ordinary way, its forward patched by the libraries' own code written
out in tests/autotune/_ordinary_losses.py (nothing of autotune's losses), trained by the ordinary loop
(tests/autotune/_allocator_truth.py) and counted by the CPU allocator: the probe's m_max and its real trials at m_max
and m_max + 1 are the allocator's, under ddp and FSDP2 x 2; a fake trial at m_max is the same figure."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import nn

from autotune.cli import main
from autotune.core.errors import TaskError
from autotune.core.mesh import Mesh
from autotune.core.schemas import MAX_BYTES, Profile
from autotune.core.setup import JobSetup
from autotune.orchestrate.config import ProbeConfig
from autotune.orchestrate.probe import probe
from autotune.search.diagnose import fake_trial, job_strategy
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.hf import LoraOptions, hf_task
from autotune.tasks.task import ProbeTask
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._hf_configs import write_config, write_head_config
from tests.factories import profile_payload

pytest.importorskip("transformers")

from tests.autotune._ordinary_losses import patched, rng_states_of_chunked  # noqa: E402  (needs transformers)

SEQ_LEN = 32
# (loss, strategy, W) -> a budget whose limit (less the 10 % headroom) lies between m_max and m_max + 1, with
# m_max + 1 whole below the budget (the meter stops a trial only past the budget). Measured: fused-linear ddp m_max 6
# (1,041,096 B) and 7 (1,129,200 B); fsdp x 2 m_max 7 (1,063,536 B) and 8 (1,151,640 B); chunked:64 ddp m_max 6
# (1,234,504 B) and 7 (1,322,168 B).
CASES = {
    ("fused-linear", "ddp", 1, "full"): 1_200_000,
    ("fused-linear", "fsdp", 2, "full"): 1_200_000,
    ("chunked:64", "ddp", 1, "full"): 1_400_000,
    # LoRA r 4 over q_proj and v_proj: the head frozen, so Liger's function makes no gradient of its weight.
    ("fused-linear", "ddp", 1, "lora"): 1_000_000,
}
# peft scales each adapter's output by a Python float, kept by autograd as an 8-byte tensor made below the meter's
# view (tests/autotune/test_finetune.py): one per adapted module, q_proj and v_proj of the one layer.
LORA_NUMBERS_BYTES = 2 * 8


def _tiny_llama(tmp_path: Path) -> ProbeTask:
    return hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)


def _ordinary(task: ProbeTask, tuned: str, loss: str) -> Callable[[], nn.Module]:
    """The model built the ordinary way (LoRA as a script writes it), its forward patched as the library does."""
    name, _, size = loss.partition(":")
    chunk = [int(size)] if size else []
    if tuned == "full":
        return lambda: patched(task.model(), name, *chunk)
    import peft
    import transformers

    def lora() -> nn.Module:
        causal_lm = transformers.AutoModelForCausalLM.from_config(task.model().config)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = peft.get_peft_model(causal_lm, peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
        patched(model.get_base_model(), name, *chunk)  # TRL patches the causal LM under peft's wrapper
        return model  # type: ignore[no-any-return]

    return lora


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize(("loss", "strategy", "world_size", "tuned"), sorted(CASES))
def test_each_loss_is_exact_against_the_allocator_at_m_max_and_past_it(
    tmp_path: Path, loss: str, strategy: str, world_size: int, tuned: str
) -> None:
    folder = write_config(tmp_path, "llama")
    plain = hf_task(folder, lora=LoraOptions(rank=4) if tuned == "lora" else None).at_length(SEQ_LEN)
    task = dataclasses.replace(plain, lm_loss=loss)
    budget = CASES[(loss, strategy, world_size, tuned)]
    config = ProbeConfig(device="cpu", budget_bytes=budget, strategy=strategy, world_size=world_size, presearch=False)  # type: ignore[arg-type]
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert measured.tags["lm_loss"] == loss and 2 <= m_max < 64
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake}
    ordinary = _ordinary(hf_task(folder), tuned, loss)
    truth = {m: allocator_peak_bytes(plain, m, world_size=world_size, model=ordinary) for m in (m_max, m_max + 1)}
    # What the meter cannot see: torch.utils.checkpoint keeps the CPU generator's state (a tensor made below the
    # dispatcher) for each of TRL's chunks until its backward, and the peak holds every chunk of the forward; peft's
    # numbers (above). Host memory on a card.
    name, _, size = loss.partition(":")
    lora_bytes = LORA_NUMBERS_BYTES if tuned == "lora" else 0
    kept = {m: lora_bytes + (rng_states_of_chunked(m, SEQ_LEN, int(size)) if name == "chunked" else 0) for m in truth}
    print(
        f"--loss {loss} {strategy} x{world_size} {tuned}: m_max {m_max}, probe {peaks}, allocator {truth}, kept {kept}"
    )
    assert (peaks[m_max], peaks[m_max + 1]) == (truth[m_max] - kept[m_max], truth[m_max + 1] - kept[m_max + 1])
    assert peaks[m_max] <= measured.limit_bytes < peaks[m_max + 1]
    # A fake trial (the pre-search's, the estimate's) gives the same figure.
    fake = fake_trial(
        task,
        m_max,
        device_type="cpu",
        strategy=job_strategy(strategy, world_size, Mesh()),
        limit_bytes=MAX_BYTES,
    )
    assert fake.peak_bytes == peaks[m_max]


def test_the_fused_loss_holds_more_sequences_than_the_plain_one(tmp_path: Path) -> None:
    plain = _tiny_llama(tmp_path)
    config = ProbeConfig(device="cpu", budget_bytes=1_100_000, headroom=0.0, presearch=False)
    fused = probe(dataclasses.replace(plain, lm_loss="fused-linear"), config)
    as_before = probe(plain, config)
    print(f"m_max plain {as_before.max_micro_batch}, fused-linear {fused.max_micro_batch}")
    # The vocabulary is 8 x the hidden size: the plain loss's logits (and their softmax's) hold the peak.
    assert fused.max_micro_batch > as_before.max_micro_batch
    assert "lm_loss" not in as_before.tags


def test_the_loss_enters_the_fingerprint_and_the_setup_and_the_plain_loss_changes_nothing(tmp_path: Path) -> None:
    plain = _tiny_llama(tmp_path)
    named_plain = dataclasses.replace(plain, lm_loss="plain")
    chunked = dataclasses.replace(plain, lm_loss="chunked")
    assert named_plain.tags == plain.tags and "lm_loss" not in plain.tags
    assert task_fingerprint(named_plain) == task_fingerprint(plain)
    fingerprints = {
        task_fingerprint(dataclasses.replace(plain, lm_loss=name)) for name in ("chunked:128", "fused-linear")
    }
    assert len(fingerprints | {task_fingerprint(plain), task_fingerprint(chunked)}) == 4
    # chunked is TRL's chunk of 256 tokens: one name, one fingerprint.
    assert chunked.lm_loss == "chunked:256" and chunked.tags["lm_loss"] == "chunked:256"
    assert task_fingerprint(chunked) == task_fingerprint(dataclasses.replace(plain, lm_loss="chunked:256"))
    # The setup a worker or the emulated child receives carries it, and applies it to the task it loads.
    job = chunked.job_setup()
    assert job.lm_loss == "chunked:256" and plain.with_setup(job).lm_loss == "chunked:256"
    assert plain.job_setup().lm_loss == "plain"
    # A profile without the tag was measured with the plain loss; with it, with its own.
    assert JobSetup.of_profile(Profile.model_validate(profile_payload())).lm_loss == "plain"
    tagged = Profile.model_validate(profile_payload(tags={"lm_loss": "fused-linear"}))
    assert JobSetup.of_profile(tagged).lm_loss == "fused-linear"
    assert JobSetup(lm_loss="plain").differences(JobSetup()) == ()
    assert JobSetup(lm_loss="fused-linear").differences(JobSetup()) == ("lm_loss",)
    with pytest.raises(TaskError, match=r"^--loss 'chunked:0': a chunk holds 1 to"):
        dataclasses.replace(plain, lm_loss="chunked:0")


def test_a_model_without_an_lm_head_is_refused_before_any_trial(tmp_path: Path) -> None:
    classifier = hf_task(write_head_config(tmp_path, "bert-seq-cls")).at_length(SEQ_LEN)
    config = ProbeConfig(device="cpu", budget_bytes=1 << 20, lm_loss="fused-linear")
    with pytest.raises(TaskError) as caught:
        config.applied_to(classifier)
    line = str(caught.value)
    assert line.startswith("--loss fused-linear: BertForSequenceClassification has no LM head to fuse")
    assert "\n" not in line and classifier.name in line
    # A head LoRA adapts is not the weight the losses read (TRL refuses it too).
    adapted = hf_task(write_config(tmp_path, "llama"), lora=LoraOptions(rank=4, targets=("q_proj", "lm_head")))
    with pytest.raises(TaskError, match=r"^--loss chunked:256: the LM head of LlamaForCausalLM is a peft\.tuners"):
        ProbeConfig(device="cpu", budget_bytes=1 << 20, lm_loss="chunked").applied_to(adapted.at_length(SEQ_LEN))


def _exit_code(argv: list[str]) -> int:
    """main's exit code, the parser's own exits (a flag it refuses) included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--loss", "chunked:0"], "argument --loss: 'chunked:0': a chunk holds 1 to 16777216 tokens"),
        (["--loss", "softmax"], "argument --loss: 'softmax' is not a loss: use plain, chunked[:N]"),
        (["--loss", "fused-linear", "--tp", "2", "--world-size", "2"], "--loss fused-linear with --tp 2: under tp"),
        (["--loss", "chunked", "--pp", "2", "--world-size", "2"], "--loss chunked:256 with --pp 2:"),
    ],
)
def test_the_cli_refuses_a_loss_it_cannot_honour_in_one_line(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _exit_code(["probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "24MiB", *flags])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and said in errors[0], errors


def test_the_cli_names_a_task_file_whose_model_has_no_lm_head(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "24MiB", "--loss", "fused-linear"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("autotune: error:")]
    assert code == 2 and len(errors) == 1, err
    assert "--loss fused-linear: GPT has no LM head to fuse" in errors[0] and "trial m=" not in err


def test_on_an_emulated_card_each_loss_runs_with_cuda_semantics_and_the_fused_one_holds_least(
    cuda_python: str, tmp_path: Path
) -> None:
    # A vocabulary 64 x the hidden size at L 256: the logits hold the plain loss's peak. bf16 autocast over fp32
    # weights: Liger's addmm into an fp32 weight gradient (out_dtype) on a card of compute capability 9.0.
    folder = write_config(tmp_path, "llama", vocab_size=4096, max_position_embeddings=256)
    peaks: dict[str, int] = {}
    for loss in ("plain", "chunked", "fused-linear"):
        out = tmp_path / f"{loss}.json"
        code = main(
            ["estimate", f"hf:{folder}", "--gpu", "h100", "--precision", "bf16", "--seq-len", "256",
             "--max-micro-batch", "8", "--micro-batches", "8", "--no-breakdown", "--loss", loss, "--output", str(out)]
        )  # fmt: skip
        assert code == 0, loss
        (raw,) = json.loads(out.read_text())
        profile = Profile.model_validate(raw)
        assert profile.tags.get("lm_loss", "plain") == ("chunked:256" if loss == "chunked" else loss)
        peaks[loss] = next(t.allocated_bytes or 0 for t in profile.trials if t.micro_batch == 8)
    print(peaks)
    assert peaks["fused-linear"] < peaks["chunked"] < peaks["plain"]
