"""The operators: kernels by name, their PyTorch implementations and the fused CPU kernels' loader."""

from . import cpu_kernel


def _register_reference() -> None:
    # (imported once the library has loaded, not with `ops`: the reference operators load transformers' MoE integration)
    from . import reference

    reference.register()


cpu_kernel.ON_LOAD.append(_register_reference)  # (the reference operators, registered once the library has loaded)
