"""`parse_size` (--kv-cache-memory and the other sizes): what reads, and what is refused with
a ValueError (the launcher's and the services' one-line exit 2) instead of an OverflowError
traceback or an engine that fails after everything started."""

from __future__ import annotations

import pytest

from pdserve.shared.engine_args import parse_size


@pytest.mark.parametrize("text, size", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5G", int(1.5 * 2**30)),
    ("4TiB", 4 * 2**40), ("64k", 64 * 2**10), ("1073741824", 2**30), (4096, 4096),
])
def test_sizes_read(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "0GiB", "-1G", "-5", "inf", "infG", "nan", "-inf", 0])
def test_sizes_that_are_no_size_are_refused(text):
    with pytest.raises(ValueError, match="not a size in bytes > 0"):
        parse_size(text)


@pytest.mark.parametrize("text", ["abc", "", "G", "2GiBs"])
def test_unreadable_sizes_are_refused(text):
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size(text)
