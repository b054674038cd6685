"""Bucket planning shared by the weight sender and receivers (grpo_api.weights)."""

import pytest

from grpo_api.proto import rollout_pb2 as pb
from grpo_api.weights import (ALIGN_BYTES, TensorSpec, bucket_from_proto, bucket_to_proto, plan_buckets,
                              total_bytes)

SPECS = [TensorSpec("embed", (100, 8), "bfloat16"),      # 1600 B
         TensorSpec("norm", (3,), "float32"),             # 12 B
         TensorSpec("q", (16, 16), "bfloat16"),           # 512 B
         TensorSpec("big", (40, 40), "float32"),          # 6400 B: larger than a bucket
         TensorSpec("k", (4, 16), "bfloat16")]            # 128 B


def test_buckets_respect_the_size_and_keep_order():
    buckets = plan_buckets(SPECS, bucket_size=2048)
    assert [b.names for b in buckets] == [["embed", "norm"], ["q"], ["big"], ["k"]]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    for b in buckets:
        assert b.nbytes <= 2048 or b.names == ["big"]   # an oversized tensor gets its own bucket
        for t in b.tensors:
            assert t.offset % ALIGN_BYTES == 0
        ends = [t.offset + t.nbytes for t in b.tensors]
        assert b.nbytes == ends[-1]
        assert all(a <= next_t.offset for a, next_t in zip(ends, b.tensors[1:]))  # no overlap
    assert buckets[0].tensors[1].offset == 1600  # 1600 is already aligned
    assert total_bytes(buckets) >= sum(s.nbytes for s in SPECS)


def test_one_bucket_when_everything_fits():
    assert [b.names for b in plan_buckets(SPECS, bucket_size=1 << 20)] == [[s.name for s in SPECS]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([SPECS[0], SPECS[0]], 4096)
    with pytest.raises(ValueError, match="unsupported dtype 'complex32'"):
        plan_buckets([TensorSpec("x", (2,), "complex32")], 4096)
    with pytest.raises(ValueError, match="bucket_size"):
        plan_buckets(SPECS, 8)


def test_proto_round_trip_and_malformed_plans():
    bucket = plan_buckets(SPECS, 2048)[0]
    assert bucket_from_proto(0, bucket_to_proto(bucket)) == bucket
    lying = bucket_to_proto(bucket)
    lying.tensors[0].nbytes = 10
    with pytest.raises(ValueError, match="1600"):
        bucket_from_proto(0, lying)
    overflowing = pb.WeightBucket(tensors=bucket_to_proto(bucket).tensors, nbytes=100)
    with pytest.raises(ValueError, match="past its size"):
        bucket_from_proto(0, overflowing)
