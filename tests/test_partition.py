"""fz3.data.partition: copy/add writes, averaging, fp32 master cast."""
import pytest
import torch

from fz3.data import partition


def test_write_copy_and_add():
    old, new = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    assert torch.equal(partition.write_partition(old, new, "copy"), new)
    assert torch.equal(partition.write_partition(None, new, "copy"), new)
    assert partition.write_partition(old, new, "add").tolist() == [11, 22]
    assert old.tolist() == [1, 2] and new.tolist() == [10, 20]  # inputs untouched


@pytest.mark.parametrize("part, mode, msg", [(None, "add", r"^add into a grad partition that was never written \(expected copy\)$"),
                                             (torch.zeros(2), "avg", "unknown")])
def test_write_errors(part, mode, msg):
    with pytest.raises(ValueError, match=msg):
        partition.write_partition(part, torch.zeros(2), mode)


def test_average_and_master_cast():
    assert partition.average(torch.tensor([6.0, -3.0]), 3).tolist() == [2, -1]
    bf = torch.tensor([1.5, 2.0], dtype=torch.bfloat16)
    m = partition.to_master(bf)
    assert m.dtype == torch.float32 and m.tolist() == [1.5, 2.0]
