"""Laplace approximations as Pyro guides."""

__all__: list[str] = []
