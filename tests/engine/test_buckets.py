import pytest
import torch

from gradsync.engine.layout import MiB, plan_buckets


def floats(*numels, dtype=torch.float32):
    return [torch.empty(n, dtype=dtype) for n in numels]


def test_reverse_registration_order_and_small_first_bucket():
    params = floats(*[MiB // 4] * 6)  # 1 MiB each in fp32
    plan = plan_buckets(params, bucket_cap_mb=2, first_bucket_cap_mb=1)
    assert plan == [[5], [4, 3], [2, 1], [0]]


def test_caps_are_bytes_not_elements():
    params = floats(MiB // 8, MiB // 8, dtype=torch.float64)  # 1 MiB each in fp64
    assert plan_buckets(params, bucket_cap_mb=25, first_bucket_cap_mb=1) == [[1], [0]]


def test_groups_by_dtype():
    params = [torch.empty(10), torch.empty(10, dtype=torch.float64), torch.empty(10),
              torch.empty(10, dtype=torch.bfloat16)]
    plan = plan_buckets(params)
    assert sorted(map(sorted, plan)) == [[0, 2], [1], [3]]
    for bucket in plan:
        assert len({params[i].dtype for i in bucket}) == 1
    assert plan[0] == [3]  # ordered by the first member in the walk


@pytest.mark.parametrize("caps", [4.0, (1.0, 2.0, 8.0)])
@pytest.mark.parametrize("other", [torch.float64, torch.bfloat16])
def test_each_dtype_group_has_its_own_small_first_bucket_as_torch(caps, other):
    """The same buckets as torch's assignment, so a mixed-dtype model's sums have torch's bits at 3+ ranks."""
    import torch.distributed as dist
    params = [torch.empty(300_000, dtype=other if i % 3 == 0 else torch.float32) for i in range(12)]
    order = list(range(11, -1, -1))
    cap_list = list(caps) if isinstance(caps, tuple) else [caps]
    limits = [MiB] + [int(c * MiB) for c in (cap_list[1:] or cap_list)]
    theirs, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], limits, [False] * 12, order)
    ours = plan_buckets(params, bucket_cap_mb=caps, first_bucket_cap_mb=1.0, order=order)
    assert sorted(map(sorted, ours)) == sorted(sorted(b) for b in theirs)


def test_every_parameter_once_and_order_respected():
    params = floats(*range(1, 40))
    order = list(range(39))
    plan = plan_buckets(params, bucket_cap_mb=100 / MiB, first_bucket_cap_mb=30 / MiB, order=order)
    flat = [i for b in plan for i in b]
    assert flat == order
    assert sum(params[i].numel() * 4 for i in plan[0]) >= 30


def test_huge_cap_gives_one_bucket():
    assert plan_buckets(floats(3, 4, 5), bucket_cap_mb=1000, first_bucket_cap_mb=1000) == [[2, 1, 0]]


@pytest.mark.parametrize("bad", [dict(bucket_cap_mb=0), dict(first_bucket_cap_mb=-1), dict(order=[0, 0])])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        plan_buckets(floats(1, 2), **bad)


def test_a_list_of_caps_gives_each_bucket_its_own_cap():
    params = floats(*[MiB // 4] * 7)  # 1 MiB each in fp32
    plan = plan_buckets(params, bucket_cap_mb=[1, 2, 3], first_bucket_cap_mb=1)
    assert plan == [[6], [5, 4], [3, 2, 1], [0]]  # the last cap repeats
    with pytest.raises(ValueError):
        plan_buckets(params, bucket_cap_mb=[1, 0])


def test_a_fractional_cap_counts_whole_bytes_as_torch():
    # torch's DDP caps a bucket at int(bucket_cap_mb * 2**20) bytes; 104.5 bytes is 104: a bucket of two
    # 13-float parameters (104 bytes) is full, so a comm hook sees torch's buckets
    cap = 104.5 / MiB
    assert plan_buckets(floats(13, 13, 13), bucket_cap_mb=cap, first_bucket_cap_mb=cap) == [[2, 1], [0]]
