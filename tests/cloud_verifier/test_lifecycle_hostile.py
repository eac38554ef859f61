"""The verifier's lifecycle, health and keys under hostile conditions: a key file with '#' in a
key, reloaded on SIGHUP; missing files on the command line; the API docs behind the key; a burst
after idling; SIGTERM with HTTP streams in flight."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_verifier.auth import AuthError, KeyStore


# ------------------------------------------------------------------------------- the key file
def test_a_hash_inside_a_key_is_part_of_it(tmp_path: Path) -> None:
    """'#' starts a comment only as the first character of a word; it used to cut every line at its
    first '#', so the key 'k-7b#e2' became 'k-7b' (and 'k-7b' was let in)."""
    f = tmp_path / "keys"
    f.write_text("# a comment line\n  # an indented one\nk-7b#e2 trusted  # the rest is a comment\nk-9#\n")
    keys = KeyStore.from_file(str(f))
    assert keys.authenticate("k-7b#e2").trusted
    assert not keys.authenticate("k-9#").trusted
    for wrong in ("k-7b", "k-9", "#", "the"):
        with pytest.raises(AuthError, match="unknown API key"):
            keys.authenticate(wrong)


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("k-1 trusted\nk-2\nk-1\n")
    with pytest.raises(ValueError, match=r"keys:3: this key is already on line 1"):
        KeyStore.from_file(str(f))


def test_reload_swaps_the_keys_and_a_bad_file_keeps_them(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("k-old\nk-stay sessions=2\n")
    keys = KeyStore.from_file(str(f))
    stay = keys.authenticate("k-stay").name
    f.write_text("k-new trusted\nk-stay sessions=3\n")
    assert keys.reload(str(f)) == 2
    with pytest.raises(AuthError):
        keys.authenticate("k-old")
    assert keys.authenticate("k-new").trusted
    assert keys.authenticate("k-stay").name == stay  # its per-key counts carry on
    assert keys.authenticate("k-stay").max_sessions == 3
    assert keys.authenticate("k-new").name not in (stay, "key#0")  # never a removed key's name
    for bad in ("k-x sessions=lots\n", "# nothing\n"):
        f.write_text(bad)
        with pytest.raises(ValueError, match=r"keys:1|no keys"):
            keys.reload(str(f))
        assert keys.authenticate("k-new").trusted
    f.unlink()
    with pytest.raises(OSError):
        keys.reload(str(f))
    assert keys.authenticate("k-new").trusted
