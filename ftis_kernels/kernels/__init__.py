"""Row kernels over the vocabulary and their dispatch.

`select_backend` is the one public choice of implementation, by where the tensors live: CUDA ->
compiled Triton kernels; CPU with the kernels decorated under TRITON_INTERPRET=1 -> the same Triton
kernels, interpreted; CPU otherwise -> the chunked PyTorch path with the same results. `FORWARD`
and `BACKWARD` map a backend to its row passes (Triton: `logp_lse.py`; CPU PyTorch:
`logp_lse_cpu.py`): the ops, the tests and the benchmarks import these names. The per-sample part
between the row passes is `per_sample.py` on the Triton backend.
"""

from __future__ import annotations

import torch

from ftis_kernels.kernels import logp_lse, logp_lse_cpu

BACKENDS = ("triton", "torch")
FORWARD = {"triton": logp_lse.logp_lse_fwd, "torch": logp_lse_cpu.logp_lse_fwd_torch}
BACKWARD = {"triton": logp_lse.logits_bwd, "torch": logp_lse_cpu.logits_bwd_torch}


def select_backend(device: torch.device) -> str:
    """ "triton" for CUDA tensors and for CPU tensors under the Triton interpreter, else "torch"."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton" if logp_lse.triton_is_interpreted() else "torch"
    raise ValueError(f"logits: expected a CUDA or CPU tensor, got a tensor on {device}")


__all__ = ["BACKENDS", "BACKWARD", "FORWARD", "select_backend"]
