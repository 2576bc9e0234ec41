"""Train a small MLP with OffloadAdamW and check it against torch.optim.AdamW step by step.

Runs on the CPU in seconds; on a GPU it also prints the device memory the optimizer state
would have taken.

    python examples/plain_pytorch.py
"""

from __future__ import annotations

import copy

import torch

from lightning_offload_optim import OffloadAdamW


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)
    ).to(device)
    reference = copy.deepcopy(model)  # the same weights, trained with torch's AdamW

    optimizer = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, fused=True)

    x = torch.randn(512, 256, device=device)
    y = torch.randint(0, 10, (512,), device=device)
    differing_steps = []
    for step in range(50):
        for net, opt in ((model, optimizer), (reference, torch_adamw)):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        if not all(torch.equal(a, b) for a, b in pairs):
            differing_steps.append(step)
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    stats = optimizer.memory_stats()
    print(f"bit-identical to torch.optim.AdamW(fused=True) at every step: {not differing_steps}")
    if differing_steps:
        print(f"parameters differed after steps {differing_steps}")
    print(
        f"optimizer state held in host memory: {stats['state_bytes'] / 2**20:.1f} MiB "
        f"(host buffers {stats['host_bytes'] / 2**20:.1f} MiB, pinned: {stats['pinned']})"
    )
    if device == "cuda":
        print(f"device memory saved: {stats['state_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
