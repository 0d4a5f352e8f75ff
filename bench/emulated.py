"""CPU semantics against emulated cards: m_max, the figure at m_max and seconds, for the examples.

    .venv/bin/python bench/emulated.py [--budget 2GiB] [--cards h100,h200] [--tasks examples/gpt.py:task,...]
    .venv/bin/python bench/emulated.py --part 7b    # the 7B fsdp x 8 estimate at four lengths on an emulated H100
    .venv/bin/python bench/emulated.py --part cnn   # the CNN on an emulated H200 against the card (cuDNN workspaces)

The examples' table also has a Llama-style bf16 model (``hf:`` of a config written here: 8 layers, hidden
512, 8 heads over 2 key-value heads, L = 512, bf16 autocast): its attention is cuDNN's on sm_90 and flash on
sm_80, with their backward temporaries (autotune/core/kernel_temporaries.py). Seconds per fake trial are the
estimate's wall seconds over its fake trials (the child's torch import included).

CPU semantics: `autotune estimate --device-kind cuda` on this torch (a CPU build: live tensor bytes, no
allocator, no context). Emulated: `autotune estimate --gpu CARD` (CUDA semantics in a child process, the
caching allocator's reserved bytes + the memory outside it). Each run is a CLI process of its own.
Where the real H200 figure is known (../shared/gpu-runs: the GPT example at 2 GiB held m = 1212), it is
printed beside.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KNOWN_H200_M_MAX = {("examples/gpt.py:task", "2GiB"): 1212, ("examples/cnn.py:task", "2GiB"): 1152}
LLAMA_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 512,
    "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}  # fmt: skip
LLAMA_FLAGS = ["--seq-len", "512", "--max-seq-len", "512", "--precision", "bf16"]
LLAMA_BUDGET = "16GiB"  # 55 M parameters with AdamW in fp32 and a 32000-word head: 2 GiB holds no sequence


def _estimate(
    task: str, budget: str, extra: list[str], env: dict[str, str] | None = None
) -> tuple[int, int, float, int]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "p.json"
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "autotune.cli", "estimate", task, "--budget", budget, "--output", str(out), *extra],
            capture_output=True,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{task} {extra}: {done.stderr.strip().splitlines()[-1]}")
        profile = json.loads(out.read_text())
    if isinstance(profile, list):  # a run over lengths writes an array: the bench asks for one length
        (profile,) = profile
    m_max = profile["max_micro_batch"]
    at = [t["peak_bytes"] for t in profile["trials"] if t["micro_batch"] == m_max]
    return m_max, at[0] if at else -1, seconds, len(profile["trials"])


SEVEN_B_LENGTHS = (2048, 4096, 8192, 16384)


def part_7b() -> None:
    """`autotune estimate examples/gpt.py:task_7b_seq --gpu h100 --seq-len 2048,4096,8192,16384 --strategy fsdp
    --world-size 8`: wall seconds and the peak RSS of its processes (the CLI and the emulated card's child)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from surface import _tree_rss_bytes

    command = [
        sys.executable, "-m", "autotune.cli", "estimate", "examples/gpt.py:task_7b_seq", "--gpu", "h100",
        "--seq-len", ",".join(map(str, SEVEN_B_LENGTHS)), "--strategy", "fsdp", "--world-size", "8",
        "--target-tokens", str(4 << 20), "--json",
    ]  # fmt: skip
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = 0
    while child.poll() is None:
        rss = max(rss, _tree_rss_bytes(child.pid))
        time.sleep(1.0)
    stdout, stderr = child.communicate()
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"the 7B estimate failed: {stderr.strip().splitlines()[-2:]}")
    print("examples/gpt.py:task_7b_seq on an emulated H100, fsdp over 8 ranks, bf16 (reserved + outside)")
    for p in json.loads(stdout):
        figure = [t["peak_bytes"] for t in p["trials"] if t["micro_batch"] == p["max_micro_batch"]]
        print(
            f"  L={p['seq_len']:>6} m_max {p['max_micro_batch']:>3}  figure at m_max "
            f"{(figure[0] / 2**30 if figure else float('nan')):.2f} GiB  fake trials {len(p['trials'])}"
        )
    print(f"  wall {seconds:.1f} s (target < 150 s), peak RSS {rss / 2**30:.2f} GiB (target < 2 GiB)")


# The CNN example on the real H200 of 2026-11-30 (../shared/gpu-runs/2026-11-30-h200-gpu_check.log): m = 234 at
# 1 GiB (bench/gpu_train_check.py), 1152 at 2 GiB (the CLI probe: fit 797.70 MiB + 926.51 KiB per sample);
# at 3 and 4 GiB that fit's line, not a measurement.
CNN_CARD = {
    "1GiB": "234 (card)",
    "2GiB": "1152 (card)",
    "3GiB": "2174 (card's fit line)",
    "4GiB": "3192 (card's fit line)",
}


def part_cnn() -> None:
    """`autotune estimate examples/cnn.py:task --gpu h200` at four budgets with cuDNN's convolution workspaces at
    the stated bound (autotune/core/kernel_temporaries.py: convolution_workspace_bound), and at 2 GiB under
    CUDNN_CONV_WSCAP_DBG caps (each workspace min(bound, cap))."""
    print("| budget | CUDNN_CONV_WSCAP_DBG | m_max | figure at m_max (MiB) | seconds | fake trials | real H200 |")
    print("|---|---|---|---|---|---|---|")
    runs = [(budget, None) for budget in CNN_CARD] + [("2GiB", cap) for cap in ("0", "64", "256", "512")]
    for budget, cap in runs:
        env = None if cap is None else {"CUDNN_CONV_WSCAP_DBG": cap}
        try:
            m, figure, seconds, trials = _estimate("examples/cnn.py:task", budget, ["--gpu", "h200"], env)
            cells = f"{m} | {figure / 2**20:.1f} | {seconds:.1f} | {trials}"
        except SystemExit as exc:  # no size fits: the estimate's one line
            cells = f"none ({str(exc).split('error: ', 1)[-1]}) | | | "
        print(f"| {budget} | {cap or 'not set'} | {cells} | {CNN_CARD[budget] if cap is None else ''} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["examples", "7b", "cnn"], default="examples")
    parser.add_argument("--budget", default="2GiB")
    parser.add_argument("--cards", default="h100,h200")
    parser.add_argument("--tasks", default="examples/gpt.py:task,examples/mlp.py:task,examples/cnn.py:task")
    args = parser.parse_args()
    if args.part == "7b":
        part_7b()
        return
    if args.part == "cnn":
        part_cnn()
        return
    print("| task | semantics | m_max | figure at m_max (MiB) | seconds | fake trials | s per trial | real H200 |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(LLAMA_CONFIG))
        tasks: list[tuple[str, list[str], str]] = [(task, [], args.budget) for task in args.tasks.split(",")]
        tasks.append((f"hf:{folder}", LLAMA_FLAGS, LLAMA_BUDGET))
        for task, flags, budget in tasks:
            name = f"llama-style bf16 (hf config, L=512, {budget})" if task.startswith("hf:") else task
            real = KNOWN_H200_M_MAX.get((task, budget), "")
            cards = [(f"emulated {card}", ["--gpu", card]) for card in args.cards.split(",")]
            runs = [("CPU", ["--device-kind", "cuda"]), *cards]
            for semantics, extra in runs:
                m, figure, seconds, trials = _estimate(task, budget, [*extra, *flags])
                print(
                    f"| {name} | {semantics} | {m} | {figure / 2**20:.1f} | {seconds:.1f} | {trials} | "
                    f"{seconds / max(1, trials):.2f} | {real} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
