"""The readable PyTorch oracle of ftis-kernels (not installed; on the pytest and bench path)."""

from ref.ftis import kl_per_token, ref_ftis_loss

__all__ = ["kl_per_token", "ref_ftis_loss"]
