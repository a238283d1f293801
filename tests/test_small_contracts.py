"""sum64's tail and tensor_files.json_field's object check (mutations of both got past the suite)."""
import numpy as np
import pytest
from kvbridge.transfer.checksum import sum64
from kvbridge.transfer.tensor_files import json_field


@pytest.mark.parametrize("n", [1, 3, 7, 9, 15, 17, 1001])
def test_sum64_is_the_sum_of_the_zero_padded_little_endian_words(n):
    """kills sum64_ignore_tail (the last len % 8 bytes not summed) and sum64_tail_not_padded (the tail read as a
    big-endian number of its own length)."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    padded = data + bytes(-n % 8)
    expected = int(np.frombuffer(padded, dtype="<u8").sum(dtype=np.uint64))
    assert sum64(data) == expected
    changed = bytearray(data)
    changed[-1] ^= 1  # any change to one word, the tail's included, changes it
    assert sum64(bytes(changed)) != sum64(data)


def test_json_field_refuses_metadata_that_is_json_but_not_an_object(tmp_path):
    """kills tf_not_a_dict_ok: a list under the field must be the ValueError naming the file, not a list handed on
    (callers index it as a dict)."""
    with pytest.raises(ValueError, match="not a JSON object"):
        json_field(tmp_path / "x.safetensors", {"config": "[1, 2]"}, "config")
