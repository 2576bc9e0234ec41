"""Train a small GPT-style language model with offloaded AdamW state, in PyTorch Lightning.

Two lines make a Lightning project offload its optimizer state: inherit ``OffloadOptimizerMixin``
(first) and add ``OffloadMonitor()`` to the Trainer. The model is a character-level decoder-only
Transformer trained on text that ships with Python (a few standard-library modules' sources).

    python examples/train_gpt.py                 # CPU: 35-65 s on 2 cores; logs: ./lightning_logs
    python examples/train_gpt.py --logger tensorboard --max-steps 500
    python examples/train_gpt.py --accelerator gpu --d-model 1024 --layers 12   # on a GPU

On a GPU it then trains the same model briefly with plain ``torch.optim.AdamW`` and prints the
peak device memory of both.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_offload_optim import OffloadMonitor, OffloadOptimizerMixin

CORPUS_MODULES = ("textwrap.py", "argparse.py", "dataclasses.py", "functools.py", "inspect.py")


def load_corpus() -> str:
    """Text that every Python installation has: some standard-library sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / name).read_text(encoding="utf-8") for name in CORPUS_MODULES)


class CharDataset(Dataset):
    """Random windows of ``block_size + 1`` characters: inputs and next-character targets."""

    def __init__(self, text: str, block_size: int, samples: int) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        generator = torch.Generator().manual_seed(0)
        self.starts = torch.randint(
            0, len(self.data) - block_size - 1, (samples,), generator=generator
        )

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[self.starts[i] : self.starts[i] + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class GPT(OffloadOptimizerMixin, pl.LightningModule):
    """A decoder-only Transformer; the optimizer comes from the mixin, set by hyperparameters."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 128,
        d_model: int = 128,
        heads: int = 4,
        layers: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        lr_schedule: str = "cosine",
        offload_enabled: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=causal, is_causal=True)))

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        self.log("bits_per_char", loss / math.log(2))
        return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on GPU, 32 on CPU")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--logger", choices=("csv", "tensorboard"), default="csv")
    parser.add_argument("--log-dir", default="lightning_logs")
    args = parser.parse_args()
    pl.seed_everything(0)
    on_gpu = args.accelerator in ("gpu", "cuda")
    precision = args.precision or ("bf16-mixed" if on_gpu else "32-true")

    data = CharDataset(load_corpus(), args.block_size, samples=args.batch_size * args.max_steps)
    hparams = {
        "vocab_size": len(data.chars),
        "block_size": args.block_size,
        "d_model": args.d_model,
        "heads": max(1, args.d_model // 64),
        "layers": args.layers,
    }
    model = GPT(**hparams)
    logger_cls = TensorBoardLogger if args.logger == "tensorboard" else CSVLogger
    monitor = OffloadMonitor(prog_bar=True)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=precision,
        max_steps=args.max_steps,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        logger=logger_cls(args.log_dir, name="gpt"),
        callbacks=[monitor],
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=True))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters; logs in {trainer.logger.log_dir}")

    if on_gpu:
        compare_with_plain_adamw(model, hparams, data, args, precision)


def compare_with_plain_adamw(model, hparams, data, args, precision) -> None:
    """Peak device memory of a short run with OffloadAdamW and with plain torch.optim.AdamW."""
    peaks = {}
    for name, enabled in (("OffloadAdamW", True), ("torch.optim.AdamW", False)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run = pl.Trainer(
            accelerator="gpu",
            devices=1,
            precision=precision,
            max_steps=10,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        run.fit(
            GPT(**hparams, offload_enabled=enabled), DataLoader(data, batch_size=args.batch_size)
        )
        peaks[name] = torch.cuda.max_memory_allocated()
    for name, peak in peaks.items():
        print(f"peak GPU memory with {name:18s}: {peak / 2**30:6.2f} GiB")
    saved = peaks["torch.optim.AdamW"] - peaks["OffloadAdamW"]
    print(f"GPU memory saved by offloading the optimizer state: {saved / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
