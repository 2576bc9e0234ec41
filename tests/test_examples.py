"""The examples run as the README tells users to run them (in a fresh interpreter), and do what
they say they do."""

from __future__ import annotations

import csv
import runpy
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, cwd: Path) -> str:
    """Run ``examples/name`` with ``args``; its stdout and stderr, once it exited cleanly."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def test_plain_pytorch_example_trains_bit_identically_to_torch_adamw(tmp_path):
    """The example checks every step against torch.optim.AdamW(fused=True) and says so."""
    output = run_example("plain_pytorch.py", cwd=tmp_path)
    assert "bit-identical to torch.optim.AdamW(fused=True) at every step: True" in output


def test_train_gpt_example_offloads_and_logs_every_step(tmp_path):
    """The Lightning example (mixin + monitor, a tiny configuration): the monitor counted every
    optimizer step as OffloadAdamW's (it warns and logs nothing without one), and logged host
    state of two fp32 moments per parameter of the example's model."""
    shape = ["--block-size", "16", "--d-model", "32", "--layers", "1"]
    args = ["--max-steps", "10", "--batch-size", "4", *shape, "--log-dir", "logs"]
    output = run_example("train_gpt.py", *args, cwd=tmp_path)
    assert "10 optimizer steps so far" in output
    assert "nothing will be logged" not in output

    example = runpy.run_path(str(EXAMPLES / "train_gpt.py"))  # its classes, not its main()
    vocab = len(example["CharDataset"](example["load_corpus"](), 16, samples=1).chars)
    model = example["GPT"](vocab, block_size=16, d_model=32, heads=1, layers=1)
    params = sum(p.numel() for p in model.parameters())
    (metrics,) = (tmp_path / "logs" / "gpt").glob("version_*/metrics.csv")
    with metrics.open() as f:
        rows = [row for row in csv.DictReader(f) if row["offload/memory_saved_bytes"]]
    assert rows, "the monitor logged nothing"
    assert float(rows[-1]["offload/memory_saved_bytes"]) == 2 * 4 * params
