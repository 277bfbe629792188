"""prefetch(arr, i): ask the core to bring arr[i]'s cache line into L2 (needs numba).

LLVM's llvm.prefetch (a read, locality 2: prefetcht1 on x86) on the element's address, inside
numba kernels. Into L2, not L1: the walk it overlaps still works on the current block in L1. A
kernel that walks a block twice (once for its range, once for its codes) stalls on memory in
the first walk and computes in the second: prefetching the next block during the second walk
overlaps the two. A hint only: no fault, no effect on any value; i must lie within arr.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, arr_t, idx_t):
    def codegen(context, builder, signature, args):
        ary = context.make_array(arr_t)(context, builder, args[0])
        base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        offset = builder.mul(context.cast(builder, args[1], idx_t, types.intp),
                             context.get_constant(types.intp, arr_t.dtype.bitwidth // 8))
        i32 = ir.IntType(32)
        ptr = builder.gep(base, [offset])
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(2), i32(1)])        # read, into L2 (prefetcht1), data
        return context.get_dummy_value()
    return types.void(arr_t, idx_t), codegen
