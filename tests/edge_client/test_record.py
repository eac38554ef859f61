"""Session records (`edge-client generate --record DIR`): a folder that cannot hold them is named as the
record's problem (RecordError), a failed write leaves no half file, and a record never replaces a
file that is already there."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge_client import record
from edge_client.record import RecordError, check_folder, write_record
from edge_client.stats import GenerationResult
from tests.fs_faults import FullDiskOS

GEN = GenerationResult([1, 2, 3], [4, 5])


def test_a_folder_that_cannot_hold_records_is_a_record_error(tmp_path: Path) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    with pytest.raises(RecordError, match="it is a file, not a folder"):
        check_folder(taken)
    with pytest.raises(RecordError, match="cannot write session records into"):
        check_folder(taken / "sub")
    with pytest.raises(RecordError, match="it is a file"):
        write_record(taken, GEN, "tiny", "ff" * 16, "greedy", 0.0)
    assert taken.read_text() == "mine"
    check_folder(tmp_path / "new" / "records")  # made, and nothing left in it
    assert list((tmp_path / "new" / "records").iterdir()) == []


def test_a_failed_write_leaves_no_half_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record, "os", FullDiskOS())
    with pytest.raises(RecordError, match="No space left on device"):
        write_record(tmp_path, GEN, "tiny", "ff" * 16, "greedy", 0.0)
    assert list(tmp_path.iterdir()) == []


def test_a_record_never_replaces_a_file_already_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stamp = "20261206T120000Z"
    monkeypatch.setattr(record, "time", SimpleNamespace(strftime=lambda fmt, t: stamp, gmtime=lambda: None))
    monkeypatch.setattr(record, "_counter", iter(range(100)))
    taken = tmp_path / f"{stamp}-{os.getpid()}-0.json"
    taken.write_text("an earlier process's record")
    path = write_record(tmp_path, GEN, "tiny", "ff" * 16, "greedy", 0.0)
    assert path.name == f"{stamp}-{os.getpid()}-1.json"
    assert taken.read_text() == "an earlier process's record"
