"""The server's token file (server/auth.py): read only when other users cannot read it, as the Redis secret file."""

from __future__ import annotations

import os

import pytest
from kvbridge.server.auth import read_token_file

TOKEN = "ci-token-0123456789abcdef"


def _token_file(tmp_path, mode: int):
    path = tmp_path / "tokens"
    path.write_text(f"# tenant token\nci {TOKEN}\n")
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o400])
def test_a_token_file_only_its_owner_and_group_read_is_read(tmp_path, mode):
    assert read_token_file(_token_file(tmp_path, mode)) == {TOKEN: "ci"}


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o666, 0o602])
def test_a_token_file_other_users_can_open_is_refused_naming_it_and_its_mode(tmp_path, mode):
    path = _token_file(tmp_path, mode)
    with pytest.raises(ValueError) as info:
        read_token_file(path)
    message = str(info.value)
    assert str(path) in message and f"{mode:04o}" in message and f"chmod 600 {path}" in message, message


def test_a_token_file_that_is_not_a_regular_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        read_token_file(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        read_token_file(tmp_path / "missing")


def test_a_token_given_twice_or_one_character_short_is_refused(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice aaaaaaaaaaaaaaaa\nbob aaaaaaaaaaaaaaaa\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="same token is given twice"):
        read_token_file(path)
    path.write_text("alice " + "a" * 15 + "\n")
    with pytest.raises(ValueError, match="shorter than 16"):
        read_token_file(path)
    path.write_text("alice " + "a" * 16 + "\n")
    assert read_token_file(path) == {"a" * 16: "alice"}
