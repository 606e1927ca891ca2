"""`python -m edgespec.model.kernels`: compile the CPU kernels now (the install commands run this)."""

from edgespec.model.kernels import load

print(f"CPU kernels ready ({load().isa()} path)")
