"""Two pure steps of Triton's interpreter (TRITON_INTERPRET=1), memoized for the CPU suite.

Each interpreted launch re-patches triton.language for the interpreter: `_patch_builtin` walks a module with
inspect.getmembers to find its builtins (~6 modules a launch), and `_get_np_dtype` builds a 19-entry dict on each of
its calls. Under the suite's interpreted engines (thousands of launches) the two took ~20% of the time. Here the
builtins of each module are listed once, from the module as it is before any patching (the patch scope restores it
after every launch), and the dtype table is built once. What the interpreter computes is unchanged. Installed by
conftest (once the kernel modules set TRITON_INTERPRET) only where `_patch_builtin` has the shape this was written
against (triton 3.x); otherwise a no-op.
"""
from __future__ import annotations

import inspect


def install() -> bool:
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    if getattr(interp, "_picovllm_memoized", False):
        return True
    try:
        params = list(inspect.signature(interp._patch_builtin).parameters)
        real_np_dtype, tl = interp._get_np_dtype, interp.tl
    except (AttributeError, TypeError, ValueError):
        return False
    if params != ["pkg", "builder", "scope"] or not hasattr(interp, "_patch_attr"):
        return False

    builtins: dict[int, list] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        members = builtins.get(id(pkg))
        if members is None:
            members = builtins[id(pkg)] = [(name, member) for name, member in inspect.getmembers(pkg)
                                           if tl.core.is_builtin(member)]
        for name, member in members:
            interp._patch_attr(pkg, name, member, builder, scope)

    table: dict = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty          # what the interpreter's own table is looked up by
        key = (type(tt_dtype), getattr(tt_dtype, "name", None))
        if key[1] is None or isinstance(tt_dtype, tl.pointer_type):
            return real_np_dtype(tt_dtype)
        if key not in table:
            table[key] = real_np_dtype(tt_dtype)
        return table[key]

    interp._patch_builtin, interp._get_np_dtype = patch_builtin, np_dtype
    interp._picovllm_memoized = True
    return True
