"""fp32 master weights for a trainer in mixed precision (Megatron's `main_grad` and fp32 masters), on the
device or, with Megatron's `--optimizer-cpu-offload`, in host memory (backends/torch_trainer.py's `MasterWeights`;
the megatron trainer fills their gradients from megatron-core's fp32 buffers instead of hooks)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlbench.errors import BadInput


class MasterWeights:
    """fp32 master copies of a bf16/fp16 model's parameters, by name. A hook on each parameter adds the
    gradient its backward just accumulated (one micro-batch's, in the model's dtype) into the master's fp32
    gradient and drops it, so micro-batches add up in fp32 (Megatron's `main_grad`); the optimizer steps the
    masters; `copy_to_model` rounds them into the model's parameters. With `host`, the masters live in host
    memory: the hook copies the gradient into a (pinned) host buffer without waiting, and `flush`, after the
    backward, waits for the copies and adds the buffers into the masters' gradients."""

    def __init__(self, model: torch.nn.Module, hooks: bool = True, host: bool = False):
        self.model, self.host = model, host
        self.params = {
            name: p.detach().to(device="cpu" if host else p.device, dtype=torch.float32, copy=True).requires_grad_(True)
            for name, p in model.named_parameters()
        }
        self._pairs = ([p for _, p in model.named_parameters()], list(self.params.values()))  # (model's, masters)
        # host: one buffer per parameter in its own dtype, and the names whose buffer holds a gradient not yet added
        self.staging: dict[str, torch.Tensor] = {}
        self.pending: list[str] = []
        self.fresh: set[str] = set()  # host: names whose kept gradient buffer is stale since `zero` (not yet written)
        if host:
            for name, p in model.named_parameters():
                pin = p.device.type == "cuda"
                self.staging[name] = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
        self.hooks: list = []
        if hooks:
            self.attach()

    def attach(self) -> None:
        """Hook every parameter: its gradient goes into its master's after each backward (see the class)."""
        self.detach()
        self.hooks = [
            param.register_post_accumulate_grad_hook(
                self._stage(name) if self.host else self._accumulate(self.params[name])
            )
            for name, param in self.model.named_parameters()
        ]

    def detach(self) -> None:
        """Remove the hooks: gradients stay on the model's parameters (bench/scale.py's bare step)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    @staticmethod
    def _accumulate(master: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            # fp32 += bf16 widens each element exactly before the fp32 add: the bits of adding grad.float()
            master.grad = param.grad.float() if master.grad is None else master.grad.add_(param.grad)
            param.grad = None

        return hook

    def _stage(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if name in self.pending:  # a second gradient before the flush: add the first one now
                self.flush()
            self.staging[name].copy_(param.grad, non_blocking=True)
            self.pending.append(name)
            param.grad = None  # freed in stream order: the copy is queued before any later use of its memory

        return hook

    @torch.no_grad()
    def flush(self) -> None:
        """Host masters: wait for the staged gradients' copies, then add each into its master's fp32 gradient
        (fp32 += the model's dtype, widened exactly: the device path's bits). Nothing to do otherwise."""
        if not self.pending:
            return
        device = self._pairs[0][0].device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        for name in self.pending:
            master, grad = self.params[name], self.staging[name]
            if master.grad is None:
                master.grad = grad.to(torch.float32, copy=True)
            elif name in self.fresh:  # the kept buffer, overwritten: no fresh 2.4 GB to fault in at a real size
                master.grad.copy_(grad)
            else:
                master.grad.add_(grad)
            self.fresh.discard(name)
        self.pending.clear()

    def zero(self) -> None:
        """Host masters: the gradients start again at the next backward, their buffers kept (`settle` drops those
        that got none)."""
        self.fresh = set(self.params)

    def settle(self) -> None:
        """After a minibatch's backward: a master whose parameter got no gradient has none (as after
        `zero_grad(set_to_none=True)`), so the optimizer skips it."""
        self.flush()
        for name in self.fresh:
            self.params[name].grad = None
        self.fresh = set()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's parameters (one multi-tensor copy). Host masters on a GPU model are
        rounded on the host into the pinned staging buffers (round to nearest even, the device's rounding) and
        copied from there without waiting: half the bytes of fp32, at the pinned rate."""
        params, masters = self._pairs
        if not self.host or params[0].device.type != "cuda":
            torch._foreach_copy_(params, masters)
            return
        torch.cuda.current_stream(params[0].device).synchronize()  # no copy still reading the buffers
        staging = [self.staging[name] for name in self.params]
        torch._foreach_copy_(staging, masters)
        for param, buffer in zip(params, staging):
            param.data.copy_(buffer, non_blocking=True)

    def load(self, tensors: dict[str, torch.Tensor], source: Path, weights: str = "model.safetensors") -> None:
        """Take the masters from a checkpoint's `master/NAME` tensors (removed from `tensors`); the model's
        parameters, loaded from `source / weights`, must be those masters rounded."""
        for name, master in self.params.items():
            value = tensors.pop(f"master/{name}", None)
            if value is None or value.shape != master.shape:
                raise BadInput(
                    f"optimizer state: expected the fp32 master weight 'master/{name}' of shape "
                    f"{tuple(master.shape)} (the model trains in mixed precision)",
                    path=source,
                )
            with torch.no_grad():
                master.copy_(value)
        for name, param in self.model.named_parameters():  # model.safetensors must be these masters, rounded
            if not torch.equal(self.params[name].to(param.device, param.dtype), param.detach()):
                raise BadInput(
                    f"'{name}' is not its fp32 master weight rounded to {param.dtype} (the checkpoint was "
                    "changed or damaged after it was written)",
                    path=source / weights,
                )
        self.copy_to_model()


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """torch's `get_total_norm` (the 2-norm) of host gradients, each tensor's norm taken on torch's CPU threads at
    once (torch frees the GIL; every thread computes with the run's thread count): the same bits, in a fraction of
    the time at a real size (a norm's reduction is memory-bound on one thread)."""
    workers = min(torch.get_num_threads(), len(grads))
    if workers < 2:
        return torch.nn.utils.get_total_norm(grads)
    with ThreadPoolExecutor(workers) as pool:
        norms = list(pool.map(lambda grad: torch.linalg.vector_norm(grad, 2.0), grads))
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)
