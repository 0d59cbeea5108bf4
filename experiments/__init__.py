"""The F-TIS claims study (see study.py and README.md)."""
