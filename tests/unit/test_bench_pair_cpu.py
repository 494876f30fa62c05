"""The bench's match of PostgreSQL backends to their clients (``bench.pair_cpu``), on ``ss`` lines, and the
titles of PostgreSQL's processes of no client."""

from __future__ import annotations

from pathlib import Path

from bench import pair_cpu
from bench.pair_cpu import backend_clients

LISTED = """\
0      0      127.0.0.1:15432 127.0.0.1:40100 users:(("postgres",pid=900,fd=9),("postgres",pid=911,fd=9))
0      0      127.0.0.1:40100 127.0.0.1:15432 users:(("python",pid=500,fd=12))
0      0      127.0.0.1:15432 127.0.0.1:40200 users:(("postgres",pid=912,fd=9))
0      0      [::ffff:127.0.0.1]:34768 [::ffff:127.0.0.1]:19093 users:(("java",pid=5883,fd=148))
0      0      127.0.0.1:15432 127.0.0.1:40300 users:(("postgres",pid=913,fd=9))
0      0      127.0.0.1:40300 127.0.0.1:15432 users:(("java",pid=600,fd=40))
"""


def test_each_server_process_of_a_listed_connection_is_matched_to_its_client() -> None:
    # 900, the postmaster, still holds the socket it accepted beside its backend 911: both are
    # listed (pair_cpu never takes the postmaster for a backend); 912's client is not listed.
    assert backend_clients(LISTED, 15432) == {900: 500, 911: 500, 913: 600}
    assert backend_clients(LISTED, 5432) == {}


def test_the_processes_of_no_client_are_told_apart_by_their_title(tmp_path: Path) -> None:
    for pid, title in {1: b"postgres: walwriter \x00", 2: b"postgres: eos eos 127.0.0.1(40100) idle\x00"}.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(title)
    assert pair_cpu._title(1, tmp_path) == "postgres: walwriter"
    assert pair_cpu._title(2, tmp_path) == pair_cpu.UNMATCHED
    assert pair_cpu._title(3, tmp_path) == "ended before it was read"
