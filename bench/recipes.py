"""The recipes of docs/recipes.md at their real sizes, on emulated cards, against what others measured on the cards.

    nice .venv/bin/python bench/recipes.py                 # every recipe (minutes; GiB of RSS)
    nice .venv/bin/python bench/recipes.py --only torchao  # one group

- **torchtitan**, Llama 3.1 8B (torchtitan docs/performance.md): FSDP over 8 H100 (96 GB), bf16 as FSDP2's
  MixedPrecisionPolicy, local batch 2, L = 8192, op-level selective checkpointing; published: 82.4 GiB
  reserved (torchtitan logs ``max_reserved``). Compared: the estimate's reserved bytes at m = 2 (its figure less
  the memory outside the allocator). Where ``--ac op`` cannot run, full and every-2 bracket it.
- **torchao**, Llama 2 7B full bf16 fine-tuning on an A100 80 GB (torchao's optim README, torchtune 52d1b838,
  Alpaca): peak memory allocated 51.6 (fused AdamW), 39.3 (bitsandbytes 8-bit), 39.1 (torchao 8-bit), 33.2
  (torchao 4-bit), read as GiB (torchtune's memory log divides by 1024**3). Assumed, not published there:
  torchtune's full-finetune low-memory recipe's batch 2 with activation checkpointing, and Alpaca samples
  padded to L = 512. Compared: the estimate's allocated bytes at m = 2. torchao's 4-bit step is compiled
  (torch.compile(fullgraph=True)), which dynamo does not trace on fake tensors: the emulated card runs it eagerly,
  its states torchao's own, its temporaries the eager ops' (docs/recipes.md says what that assumes).
- **qlora**, Llama 3.1 8B with LoRA r16 over an NF4 base on an RTX 4090 at L = 2048, every layer checkpointed
  (QLoRA recipes turn gradient checkpointing on: peft's prepare_model_for_kbit_training does by default): m_max
  and the reserved bytes at m = 1; no published figure to compare.

Each run is `autotune estimate ... --json` in a child process, as a user runs it; its wall seconds and peak RSS
(the child's and its emulation child's, by wait4) are printed beside the figure. Figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
LLAMA31_8B = "hf:examples/configs/llama-3.1-8b.json"
LLAMA2_7B = "hf:examples/configs/llama-2-7b.json"


@dataclass(frozen=True)
class Recipe:
    group: str
    name: str
    args: tuple[str, ...]
    micro_batch: int
    published_gib: float | None
    # "reserved": the allocator's reserved bytes (torchtitan's max_reserved); "allocated": max_memory_allocated.
    compare: str
    source: str


TORCHTITAN: tuple[str, ...] = ("--gpu", "h100-96gb", "--strategy", "fsdp", "--world-size", "8", "--precision", "bf16")
TORCHTITAN += ("--seq-len", "8192", "--micro-batches", "2", "--max-micro-batch", "4")
TORCHAO: tuple[str, ...] = ("--gpu", "a100-80gb", "--weights-dtype", "bf16", "--ac", "full", "--seq-len", "512")
TORCHAO += ("--micro-batches", "2", "--max-micro-batch", "8")
QLORA: tuple[str, ...] = ("--gpu", "rtx-4090", "--lora-rank", "16", "--quantize", "nf4")
QLORA += ("--weights-dtype", "bf16", "--ac", "full", "--seq-len", "2048")
QLORA += ("--micro-batches", "1", "--max-micro-batch", "8")
# The same job over 128 ranks (torchtitan's Table 3).
TORCHTITAN_128 = tuple("128" if i and TORCHTITAN[i - 1] == "--world-size" else a for i, a in enumerate(TORCHTITAN))
RECIPES = (
    Recipe("torchtitan", "llama3.1-8b fsdp x8 op", (LLAMA31_8B, *TORCHTITAN, "--ac", "op"), 2, 82.4, "reserved",
           "torchtitan docs/performance.md, Table 1, 8 x H100 96 GB"),
    Recipe("torchtitan", "llama3.1-8b fsdp x128 op", (LLAMA31_8B, *TORCHTITAN_128, "--ac", "op"), 2, 67.0,
           "reserved", "torchtitan docs/performance.md, Table 3, 128 x H100 96 GB"),
    Recipe("torchtitan", "llama3.1-8b fsdp x8 op compile", (LLAMA31_8B, *TORCHTITAN, "--ac", "op", "--compile"), 2,
           77.0, "reserved", "Table 1, FSDP + torch.compile (the estimate runs the eager step: docs/compile.md)"),
    Recipe("torchtitan", "llama3.1-8b fsdp x128 op compile",
           (LLAMA31_8B, *TORCHTITAN_128, "--ac", "op", "--compile"), 2, 62.0, "reserved",
           "Table 3, FSDP + torch.compile (the estimate runs the eager step)"),
    Recipe("torchtitan", "llama3.1-8b fsdp x8 every-2", (LLAMA31_8B, *TORCHTITAN, "--ac", "every-2"), 2, 82.4,
           "reserved", "bracket of op (more kept)"),
    Recipe("torchtitan", "llama3.1-8b fsdp x8 full", (LLAMA31_8B, *TORCHTITAN, "--ac", "full"), 2, 82.4, "reserved",
           "bracket of op (less kept)"),
    Recipe("torchao", "llama2-7b AdamW fused", (LLAMA2_7B, *TORCHAO, "--optimizer", "torch.optim.AdamW:fused=true"),
           2, 51.6, "allocated", "torchao optim README: PyTorch (fused)"),
    Recipe("torchao", "llama2-7b adamw8bit (bitsandbytes)", (LLAMA2_7B, *TORCHAO, "--optimizer", "adamw8bit"), 2,
           39.3, "allocated", "torchao optim README: bnb 8-bit (ao 8-bit 39.1)"),
    Recipe("qlora", "llama3.1-8b qlora r16 nf4 full", (LLAMA31_8B, *QLORA), 1, None, "reserved",
           "no published figure: the card's answer only"),
    Recipe("torchao", "llama2-7b adamw4bit", (LLAMA2_7B, *TORCHAO, "--optimizer", "adamw4bit"), 2, 33.2,
           "allocated", "torchao optim README: ao 4-bit"),
)  # fmt: skip


def run(recipe: Recipe) -> dict[str, object]:
    """One estimate in a child process: its profile (or its error line), wall seconds and peak RSS."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        command = [sys.executable, "-m", "autotune.cli", "estimate", *recipe.args, "--output", str(out)]
        started = time.perf_counter()
        with open(Path(folder) / "err", "w+") as err:
            process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            lines = [line for line in err.read().splitlines() if line.startswith(("autotune:", "  warning"))]
        seconds = time.perf_counter() - started
        result: dict[str, object] = {
            "seconds": seconds,
            "rss_bytes": usage.ru_maxrss * 1024,
            "code": process.returncode,
        }
        if process.returncode != 0 or not out.exists():
            result["error"] = next((line for line in lines if line.startswith("autotune:")), "no profile written")
            return result
        profile = json.loads(out.read_text())
    if isinstance(profile, list):  # --seq-len: one profile per length, one length here
        profile = profile[0]
    trial = next((t for t in profile["trials"] if t["micro_batch"] == recipe.micro_batch), None)
    result["max_micro_batch"] = profile["max_micro_batch"]
    if trial is not None:
        outside = trial.get("outside_allocator_bytes") or 0
        result["reserved_bytes"] = trial["peak_bytes"] - outside
        result["allocated_bytes"] = trial.get("allocated_bytes")
        result["fits"] = trial["fits"]
        if trial.get("oom"):  # the replay ran out of the card's memory: no figure, only the verdict
            result["reserved_bytes"] = result["allocated_bytes"] = "over the card"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--only", choices=sorted({r.group for r in RECIPES}), help="one group of recipes")
    args = parser.parse_args(argv)
    print("| recipe | m | estimate | published | error | m_max | wall s | peak RSS | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    for recipe in RECIPES:
        if args.only and recipe.group != args.only:
            continue
        found = run(recipe)
        published = "-" if recipe.published_gib is None else f"{recipe.published_gib} GiB"
        wall, rss = f"{found['seconds']:.0f}", f"{int(found['rss_bytes']) / GiB:.2f} GiB"  # type: ignore[call-overload]
        if "error" in found:
            print(f"| {recipe.name} | {recipe.micro_batch} | refused/failed: {found['error']} | "
                  f"{published} | - | - | {wall} | {rss} | {recipe.source} |")  # fmt: skip
            continue
        figure = found.get(f"{recipe.compare}_bytes")
        if figure == "over the card":
            print(f"| {recipe.name} | {recipe.micro_batch} | over the card's memory | {published} | - | "
                  f"{found['max_micro_batch']} | {wall} | {rss} | {recipe.source} |")  # fmt: skip
            continue
        if not isinstance(figure, int):
            m_max = found["max_micro_batch"]
            print(f"| {recipe.name} | {recipe.micro_batch} | no trial at m | | | {m_max} | {wall} | {rss} | |")
            continue
        estimate_gib = figure / GiB
        error = "" if recipe.published_gib is None else f"{100 * (estimate_gib / recipe.published_gib - 1):+.1f} %"
        print(
            f"| {recipe.name} | {recipe.micro_batch} | {estimate_gib:.2f} GiB {recipe.compare} | "
            f"{published} | {error} | {found['max_micro_batch']} | {wall} | {rss} | {recipe.source} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
