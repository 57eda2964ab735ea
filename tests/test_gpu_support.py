"""tests/_support/gpu.py's run_check, which every GPU test leans on: a check passes only when it
exits 0, prints a PASS line and no FAIL line (on CPU, with stand-in scripts)."""

import pytest

from _support.gpu import run_check


@pytest.mark.parametrize("body,match", [
    ("print('PASS a')\nprint('FAIL b')", "1 FAIL line"),
    ("print('PASS a')\nraise SystemExit(3)", "exited 3"),
    ("print('nothing checked')", "checked nothing"),
])
def test_a_check_that_fails_or_checks_nothing_fails_the_test(tmp_path, body, match):
    script = tmp_path / "check.py"
    script.write_text(body + "\n")
    with pytest.raises(AssertionError, match=match):
        run_check(str(script), timeout=120)


def test_a_passing_check_on_two_ranks_passes(tmp_path):
    script = tmp_path / "check.py"
    script.write_text("import os\nprint('PASS rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    out = run_check(str(script), ranks=2, timeout=300)
    assert "PASS rank 0 of 2" in out and "PASS rank 1 of 2" in out
