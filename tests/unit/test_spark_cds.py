"""The tests' Spark class archive: found, dumped once, and never in the way when a dump fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import spark_cds

OPTS = "-XX:TieredStopAtLevel=1"


def test_an_archive_is_dumped_once_then_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dumps: list[Path] = []

    def dump(stack: dict, folder: Path, archive: Path, jvm_opts: str) -> None:
        dumps.append(archive)
        archive.write_bytes(b"jsa")

    monkeypatch.setattr(spark_cds, "_dump", dump)
    (tmp_path / "spark-cds").mkdir()
    stale = [tmp_path / "spark-cds" / "driver-0000.jsa", tmp_path / "spark-cds" / "driver-1111.jsa.cdsx.part"]
    for path in stale:
        path.write_bytes(b"old")
    first = spark_cds.driver_archive_opts({}, tmp_path, OPTS)
    assert first == f"-XX:SharedArchiveFile={dumps[0]}" and dumps[0].parent == tmp_path / "spark-cds"
    assert not any(path.exists() for path in stale)  # older archives and an interrupted dump's part
    assert spark_cds.driver_archive_opts({}, tmp_path, OPTS) == first and len(dumps) == 1
    # Other JVM options, another archive.
    assert spark_cds.driver_archive_opts({}, tmp_path, OPTS + " -XX:+UseSerialGC") != first and len(dumps) == 2


def test_a_failed_dump_leaves_the_tests_without_the_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def dump(stack: dict, folder: Path, archive: Path, jvm_opts: str) -> None:
        raise AssertionError("app did not finish in 300s")

    monkeypatch.setattr(spark_cds, "_dump", dump)
    assert spark_cds.driver_archive_opts({}, tmp_path, OPTS) == ""
    assert "no archive: AssertionError: app did not finish in 300s" in capsys.readouterr().out
    assert list((tmp_path / "spark-cds").iterdir()) == []
