"""Cutting a model into pipeline stages."""

from pipesched.partition.sequential import balance_by_params, check_balance, split_sequential

__all__ = ["balance_by_params", "check_balance", "split_sequential"]
