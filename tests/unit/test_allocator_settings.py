"""The CUDA allocator settings a GPU worker applies (dtlaunch.train.parallel.process_group.allocator_settings)."""

from __future__ import annotations

import pytest

from dtlaunch.train.parallel.process_group import allocator_settings


def test_expandable_segments_by_default() -> None:
    assert allocator_settings({}) == "expandable_segments:True"


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_allocator_settings_win(var: str) -> None:
    assert allocator_settings({var: "max_split_size_mb:512"}) == ""
