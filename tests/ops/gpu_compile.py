"""The Triton kernels an op launches, compiled for a Hopper GPU (sm_90) on a machine without one.

Why: CPU CI runs every kernel in Triton's interpreter, which executes the kernel's Python and so accepts code the
compiler rejects (a ``tl.constexpr`` reassigned in a ``static_range`` loop ran in every CPU test of session 36 and
failed to compile on the GPU). This closes that gap without a GPU: :func:`record_launches` runs an op under the
interpreter and notes each launch as the GPU launcher would specialise it (argument types, 16-byte divisibility,
integers equal to 1 as constants, the constexprs, the launch options); :func:`compile_launches`, in a
process where the kernels are compiled rather than interpreted (``python -m tests.ops.gpu_compile`` reads the
launches as JSON on stdin), compiles each for ``GPUTarget("cuda", 90, 32)`` with the ptxas bundled in Triton's
wheel, so PTX and SASS generation run too.

What differs from a launch on the GPU: the shapes are the caller's (small), as are the tile sizes where an op
picks other ones for the interpreter (test_kernels_compile sets the GPU's); ``do_not_specialize`` is not mirrored
(no kernel here uses it); and the constexprs that pick tensor-core dots (:data:`NATIVE_DOTS`) are set as a GPU sets
them for the inputs' dtype (True for 16-bit ones), since the interpreter asks for exact float32 products whatever
the dtype.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from contextlib import contextmanager

# The constexprs by which a kernel takes its dots on tensor cores (16-bit inputs on a GPU) or as exact float32
# products (float32 inputs, and the interpreter, whose 16-bit tl.dot multiplies bit patterns: triton_common.dot).
NATIVE_DOTS = ("NATIVE", "NATIVE_DOT")
# Shared memory one block may take on sm_90 (H100, H200): 227 KiB; a launch asking more fails on the GPU only.
SM90_SHARED_BYTES = 227 * 1024


def _encode(value):
    """A constexpr's value as JSON: triton dtypes as {"dtype": name}, the rest as they are."""
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    if isinstance(value, tl.constexpr):
        return _encode(value.value)
    return value


def _decode(value):
    import triton.language as tl

    return tl.dtype(value["dtype"]) if isinstance(value, dict) else value


def describe_launch(kernel, args: tuple, kwargs: dict, native_dots: bool) -> dict:
    """One launch of ``kernel`` (an interpreted Triton function) with these arguments, as the GPU launcher would
    specialise it, with :data:`NATIVE_DOTS` set to ``native_dots``: {"module", "name", "signature", "constexprs",
    "divisible" (argument indices), "options"}."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    parameters = inspect.signature(kernel.fn).parameters
    values = dict(zip(kernel.arg_names, args))
    values.update({name: value for name, value in kwargs.items() if name in parameters})
    signature, constexprs, divisible = {}, {}, []
    for index, name in enumerate(kernel.arg_names):
        value = values.get(name, parameters[name].default)
        if "constexpr" in str(parameters[name].annotation):
            kind, key = "constexpr", native_dots if name in NATIVE_DOTS else value
        else:
            kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = _encode(key)
        elif key == "D":  # the launcher's mark for a pointer or integer divisible by 16
            divisible.append(index)
    options = {name: value for name, value in kwargs.items() if name not in parameters}
    return dict(module=kernel.fn.__module__, name=kernel.fn.__name__, signature=signature, constexprs=constexprs,
                divisible=divisible, options=options)


@contextmanager
def record_launches(native_dots: bool):
    """Within the block, every launch of an interpreted kernel is also appended, described
    (:func:`describe_launch`) with the dots a GPU would take (``native_dots``: True for 16-bit inputs), to the list
    this yields, once per distinct specialisation."""
    from triton.runtime.interpreter import InterpretedFunction

    launches, run = [], InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launch = describe_launch(self, args, kwargs, native_dots)
        if launch not in launches:
            launches.append(launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def compile_launches(launches: list[dict]) -> list[str]:
    """Compiles each launch for sm_90; returns one line per launch that failed ("module.kernel: error"): one that
    does not compile, one that needs more shared memory than an sm_90 block gets, one with a keyword argument that
    is neither a parameter of its kernel nor a compile option. Call where the
    kernels are compiled, not interpreted (TRITON_INTERPRET unset when their modules were imported)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    option_names = {field.name for field in dataclasses.fields(CUDAOptions)}
    failures = []
    for launch in launches:
        where = f"{launch['module']}.{launch['name']}"
        # The interpreter drops a keyword that is neither a parameter nor an option; the GPU launcher refuses it.
        unknown = sorted(set(launch["options"]) - option_names)
        if unknown:
            failures.append(f"{where}: keyword arguments it does not take: {', '.join(unknown)}")
            continue
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        constexprs = {name: _decode(value) for name, value in launch["constexprs"].items()}
        attrs = {(index,): [["tt.divisibility", 16]] for index in launch["divisible"]}
        try:
            compiled = triton.compile(ASTSource(kernel, launch["signature"], constexprs=constexprs, attrs=attrs),
                                      target=target, options=launch["options"])
        except Exception as error:  # noqa: BLE001 -- every compiler failure is reported, with its kernel
            failures.append(f"{where}: {type(error).__name__}: {error}")
            continue
        if compiled.metadata.shared > SM90_SHARED_BYTES:
            failures.append(f"{where}: needs {compiled.metadata.shared} bytes of shared memory, an sm_90 block "
                            f"gets at most {SM90_SHARED_BYTES}")
    return failures


if __name__ == "__main__":
    for line in compile_launches(json.load(sys.stdin)):
        print(line)
