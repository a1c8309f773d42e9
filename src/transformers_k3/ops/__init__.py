"""The operators: kernels by name, their PyTorch implementations and the fused CPU kernels' loader."""

from . import cpu_kernel, reference

cpu_kernel.ON_LOAD.append(reference.register)  # (the reference operators, registered once the library has loaded)
