"""Triton's interpreter made to pass float arguments as a compiled kernel receives them."""

from __future__ import annotations


def floats_as_compiled() -> None:
    """Make the interpreter pass a Python float argument as a compiled kernel gets it: as a
    float32 (the interpreter keeps the float64; a kernel that needed the float64 passed every
    interpreter test and gave another exponent on an H200, session 30). Constexprs stay as
    they are (Triton folds them at compile time)."""
    import inspect

    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter.InterpretedFunction.run, "_floats_as_compiled", False):
        return
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        params = inspect.signature(self.fn).parameters
        constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        names = list(params)

        def f32(name: str, value: object) -> object:
            if type(value) is float and name not in constexprs:
                return float(np.float32(value))
            return value

        args = tuple(f32(names[i], a) for i, a in enumerate(args))
        kwargs = {k: f32(k, v) for k, v in kwargs.items()}
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._floats_as_compiled = True  # type: ignore[attr-defined]
    interpreter.InterpretedFunction.run = run  # type: ignore[method-assign]
