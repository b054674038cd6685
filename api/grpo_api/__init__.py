"""grpo_api: the contract every part of grpo-operator shares (spec, CRD, gRPC, records, storage).

Imports no torch and none of the other grpo packages.
"""

__version__ = "0.1.0"
