"""spin(flag, seen, limit): wait for flag[0] to change without holding the GIL (needs numba).

An atomic (acquire) load of flag[0] in a nogil numba loop, `limit` reads at most: returns
the value once it differs from `seen`, else `seen`. lowmem's pool threads (threads.py) wait
on it for the next task, and the caller for a range to finish, before they block on a lock.

publish_and_spin(out, value, flag, seen, limit): out[0] = value (an atomic store with release
ordering), then spin(flag, seen, limit), all without the GIL: a pool thread says its range is
done with it, so the GIL is already free when the caller, spinning on out, sees the value (a
store made while holding the GIL had the caller wake into a GIL the worker still held, and
wait on it).
"""
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernel_cache import install

install()                   # this module's kernels too are cached package-wide (kernel_cache.py)


@intrinsic
def _load_acquire(typingctx, arr_t, idx_t):
    """arr[idx] by an atomic load with acquire ordering: read afresh on every iteration (a
    plain load of memory the loop never writes could be hoisted out of it)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(arr_t)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arr_t, ary, [args[1]])
        return builder.load_atomic(ptr, ordering="acquire", align=arr_t.dtype.bitwidth // 8)
    return arr_t.dtype(arr_t, idx_t), codegen


@intrinsic
def _store_release(typingctx, arr_t, idx_t, val_t):
    """arr[idx] = val by an atomic store with release ordering (the writes before it are
    visible to a thread that reads val with an acquire load)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(arr_t)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arr_t, ary, [args[1]])
        val = context.cast(builder, args[2], signature.args[2], arr_t.dtype)
        builder.store_atomic(val, ptr, ordering="release", align=arr_t.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(arr_t, idx_t, val_t), codegen


@njit(nogil=True, cache=True)
def spin(flag, seen, limit):
    for _ in range(limit):
        v = _load_acquire(flag, 0)
        if v != seen:
            return v
    return seen


@njit(nogil=True, cache=True)
def publish_and_spin(out, value, flag, seen, limit):
    _store_release(out, 0, value)
    return spin(flag, seen, limit)
