"""BlockPool (dsv4.paging): the entries a group holds for a length, the one rule plan_step and pad_to share."""
import pytest
from dsv4 import PagedKVCache, StepRequest
from dsv4.paging import BlockPool
from dsv4.specs.config import ModelConfig


@pytest.mark.parametrize(("name", "tokens_an_entry"), [("swa", 1), ("c4", 4), ("c128", 128), ("state4", 1),
                                                        ("state128", 1)])
def test_entries_count_whole_compressed_entries_and_one_row_a_position(name, tokens_an_entry):
    pool = BlockPool(name, block_size=8, num_blocks=4, window=None)
    assert pool.tokens_an_entry == tokens_an_entry
    for num_tokens in (0, 1, 3, 4, 127, 128, 129, 1000):
        assert pool.entries(num_tokens) == num_tokens // tokens_an_entry


def test_a_planned_request_holds_the_pages_its_entries_need():
    cache = PagedKVCache(ModelConfig.preset("tiny"), [1, 2], num_blocks=256)
    cache.plan_step([StepRequest("a", 600)])
    for name, group in cache.groups.items():
        if group.window is None:  # growing groups keep every page: cdiv(entries, block_size)
            assert group.logical_pages("a") == -(-group.entries(600) // group.block_size), name
