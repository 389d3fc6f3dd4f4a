"""Conformance harness: attention implementations judged against a float64 PyTorch oracle.

``python3 -m conformance`` runs it; conformance/README.md documents the plug-in contract.
A plug-in declares a case it cannot run by raising ``NotSupported`` (or NotImplementedError).
"""
from conformance.runs import NotSupported

__all__ = ["NotSupported"]
