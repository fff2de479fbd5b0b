"""Activations as fp16 pairs with a power-of-two exponent per 32 values: the operand of the packed
(fp16x2) 4-bit decode in moe_gemv.py.

Each 32-block of a row is stored pair-major: its 16 int32 pairs as [j][word], pair j of word w holding
the activations of nibbles j and j + 4 of that word, the two codes the decode builds as one fp16x2: the
activations 8w + j and 8w + j + 4 for weights in the "packed" byte layout, 8w + 2j and 8w + 2j + 1 for
"pairs" (formats/fp4.py). So pair j of a scale group's words is one contiguous vector, loaded in the weight words' own
layout (no rearrangement through shared memory). A group's
largest magnitude lands in [2^14, 2^15) before the conversion: fp16's 11 bits hold bf16's 8 bits
exactly for every value within 2^-23 of it, and no value overflows; the exponent byte u gives the
group's values back as fp16 * 2^(u - 127). u is clamped to 1..253 (both 2^(u - 127) and its inverse
normal fp32): a group whose largest magnitude is below 2^-112 keeps fp16's subnormal spacing times
2^-126 instead of 11 bits (activations that small are zeros to any layer).
"""

import triton
import triton.language as tl

FP16_HEADROOM = tl.constexpr(14)
GROUP = tl.constexpr(32)


@triton.jit
def scaled_fp16_kernel(
    x_ptr, stride_xt, stride_xk,  # [T, K], any float dtype and strides
    out_ptr, stride_ot,  # fp16 [T, Kp] (Kp: K rounded up to a multiple of 32), pair-major per 32-block; zeros past K
    exp_ptr, stride_et,  # uint8 [T, Kp / 32]
    K, Kp, BLOCK: tl.constexpr,
    PAIRS: tl.constexpr = False,  # the weights' codes in the "pairs" byte layout
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pair = (slot & 31) >> 1  # int32 pair 4j + w of the slot's 32-block
    if PAIRS:  # the activation each slot holds
        k = (slot & -32) + 8 * (pair & 3) + 2 * (pair >> 2) + (slot & 1)
    else:
        k = (slot & -32) + 8 * (pair & 3) + (pair >> 2) + 4 * (slot & 1)
    v = tl.load(x_ptr + t * stride_xt + k.to(tl.int64) * stride_xk, mask=k < K, other=0.0).to(tl.float32)
    grouped = tl.reshape(v, [BLOCK // GROUP, GROUP])
    amax = tl.max(tl.abs(grouped), axis=1)
    # u from the exponent field of amax, clamped so that 2^(u - 127) and 2^(127 - u) are normal fp32
    u = tl.minimum(tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 255) - FP16_HEADROOM, 1), 253)
    scaled = grouped * ((254 - u) << 23).to(tl.float32, bitcast=True)[:, None]
    groups = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    n_groups = Kp // GROUP  # every group of the padded row, so a reader needs no mask
    tl.store(out_ptr + t * stride_ot + tl.reshape(slot, [BLOCK // GROUP, GROUP]), scaled.to(tl.float16),
             mask=(groups < n_groups)[:, None])
    tl.store(exp_ptr + t * stride_et + groups, u.to(tl.uint8), mask=groups < n_groups)
