"""Variational guides: mean-field Gaussian and BLoB."""

__all__: list[str] = []
