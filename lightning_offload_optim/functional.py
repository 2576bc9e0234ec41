"""The AdamW update, in one place: a functional core over lists of tensors.

Every path of :class:`~lightning_offload_optim.OffloadAdamW` (host buffers updated in place on the
CPU, or state chunks staged onto an accelerator) ends here. It calls the same fused kernel that
``torch.optim.AdamW(fused=True)`` calls, so an update over a chunk is bit-identical to torch's
fused AdamW over the whole parameter, as long as chunk boundaries inside a parameter fall on
multiples of :data:`SPLIT_ALIGNMENT` (the kernels' vector tails then match an unsplit call).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Chunk boundaries inside a parameter fall on multiples of this many elements. The CPU fused
#: kernel handles the last ``numel % vector_width`` elements of each tensor in scalar code that
#: rounds differently from its vector code (16 fp32 lanes with AVX-512; 64 covers any width).
SPLIT_ALIGNMENT = 64


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool = True,
    grad_scale: Tensor | None = None,
) -> None:
    """Apply one AdamW step in place to real tensors that share one device and dtype.

    ``steps`` hold each tensor's step count after this step's increment (one float32 scalar
    tensor per tensor, on the same device). ``max_exp_avg_sqs`` is ignored unless ``amsgrad``.
    ``decoupled_weight_decay=False`` adds the decay to the gradient instead (L2, torch's Adam).
    ``grad_scale`` (a float32 scalar tensor on the same device): the gradients are divided by it
    first, in place, as ``GradScaler`` asks of torch's fused AdamW.

    Example:
        >>> p, g = torch.ones(4), torch.full((4,), 0.5)
        >>> m, v, step = torch.zeros(4), torch.zeros(4), torch.tensor(1.0)
        >>> adamw_update([p], [g], [m], [v], [], [step], lr=0.1, beta1=0.9, beta2=0.999,
        ...              eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
        >>> p
        tensor([0.9000, 0.9000, 0.9000, 0.9000])
    """
    if not params:
        return
    device = params[0].device
    if isinstance(lr, Tensor) and lr.device.type != "cpu" and lr.device != device:
        # Not non-blocking to the host: the host kernel would read a buffer not yet written.
        lr = lr.to(device, non_blocking=device.type != "cpu")
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs if amsgrad else [],
        steps,
        amsgrad=amsgrad,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        grad_scale=grad_scale,
    )


def take_edits(masters: list[Tensor], params: list[Tensor]) -> None:
    """Where a low-precision parameter no longer equals its master copy rounded to its dtype
    (someone wrote it since the last step: a clamp, a load of other weights), the master takes
    the parameter's value; elsewhere it keeps its extra precision.

    Example:
        >>> master = torch.tensor([1.0001, 2.0001])
        >>> param = master.to(torch.bfloat16)
        >>> param[1] = 3.0  # edited by hand
        >>> take_edits([master], [param])
        >>> master
        tensor([1.0001, 3.0000])
    """
    for master, param in zip(masters, params, strict=True):
        kept = master.to(param.dtype) == param
        torch.where(kept, master, param, out=master)  # elementwise: in place is safe
