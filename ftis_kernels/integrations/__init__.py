"""Integrations with training frameworks, each in its own module and imported on demand.

`ftis_kernels.integrations.trl` (needs the `trl` extra) holds `FTISGRPOConfig` and
`FTISGRPOTrainer`. Nothing here is imported by `import ftis_kernels`, and this package imports
none of its modules, so the core never pulls in a training framework.
"""
