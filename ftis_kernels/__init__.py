"""ftis-kernels: fused Triton kernels for the F-TIS loss of collaborative GRPO.

The public names: the three ops, their options, and `raise_on_bad_values` (the value checks of a
call made with value_check="deferred"). The CPU backward's reused gradient buffer is
tuned in `ftis_kernels.grad_buffer` (`release_cpu_grad_buffer`, `reuse_cpu_grad_buffer`).
"""

from ftis_kernels.ftis_linear_loss import ftis_linear_loss
from ftis_kernels.ftis_logprobs import ftis_logprobs
from ftis_kernels.ftis_loss import ftis_loss
from ftis_kernels.options import FTISOptions
from ftis_kernels.validate import raise_on_bad_values

__all__ = [
    "FTISOptions",
    "ftis_linear_loss",
    "ftis_logprobs",
    "ftis_loss",
    "raise_on_bad_values",
]
__version__ = "0.1.0"
