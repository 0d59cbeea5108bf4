# All metadata lives in pyproject.toml; this shim exists for tools that still call setup.py.
from setuptools import setup

setup()
