from ..ops.linear import _any_global_hooks, _hooked, apply_linear  # noqa: F401
