"""The hard-limit benchmark's GPU-like allocator (experiments.bench_hard_limit.pool_as_one_region)."""

import pytest

from helpers import in_a_fresh_process

MiB = 2 ** 20
CAP_MIB = 64


def large_request_after_small_ones(one_region: bool) -> dict:
    """Under a 64 MiB cap, allocate 1, 2, 4, 8 and 16 MiB tensors (held together), free them, then ask
    for 48 MiB: with the CPU's growing regions the free memory is in regions of at most 32 MiB and
    too little is left to grow one of 48, so the request fails; in one region it fits."""
    import tensorflow as tf

    from experiments.bench_hard_limit import pool_as_one_region

    reserved = pool_as_one_region(CAP_MIB * MiB) if one_region else 0
    with tf.device("CPU:0"):
        held = [tf.zeros([size * MiB], tf.uint8) for size in (1, 2, 4, 8, 16)]
        del held
        try:
            large = tf.zeros([48 * MiB], tf.uint8)
        except tf.errors.ResourceExhaustedError:
            return {"reserved": reserved, "granted": False}
        del large
    return {"reserved": reserved, "granted": True}


@pytest.mark.slow  # 26-29 s: two capped processes, the benchmark's allocator modes compared
def test_one_region_grants_what_growing_regions_split():
    environment = {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(CAP_MIB)}
    growing = in_a_fresh_process("test_bench_hard_limit", "large_request_after_small_ones", False,
                                 test_settings=False, environment=environment)
    one = in_a_fresh_process("test_bench_hard_limit", "large_request_after_small_ones", True,
                             test_settings=False, environment=environment)
    assert not growing["granted"]
    assert one["granted"] and one["reserved"] >= (CAP_MIB - 4) * MiB
