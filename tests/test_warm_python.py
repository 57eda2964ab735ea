"""tests/_support/warm_python.py runs a script as ``python script.py`` does: what the script sees, its
output, its exit code, and a deadline that kills it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _support import warm_python

#: Prints what a script can see of how it was started.
PROBE = textwrap.dedent("""\
    import atexit, json, os, sys
    import helper  # found in the script's folder
    atexit.register(lambda: print("atexit ran"))
    facts = dict(name=__name__, file=__file__, argv=sys.argv, path=[p for p in sys.path if "site-packages" not in p],
                 cwd=os.getcwd(), rank=os.environ.get("RANK"), stdin=sys.stdin.read(),
                 main=sys.modules["__main__"].__dict__ is globals(), helper=helper.__file__)
    print(json.dumps(facts))
    sys.stdout.write("unflushed at exit")
    """)


def write_probe(tmp_path):
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "helper.py").write_text("")
    (folder / "probe.py").write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    return str(folder / "probe.py"), str(work)


def env(**extra):
    # an empty PYTHONPATH entry: the working directory, as a fresh interpreter reads it
    return dict(os.environ, PYTHONPATH=os.pathsep.join(["rel", "", os.environ.get("PYTHONPATH", "")]), **extra)


def test_a_script_sees_what_python_script_py_shows_it(tmp_path):
    script, work = write_probe(tmp_path)
    fresh = subprocess.run([sys.executable, script, "a", "b"], cwd=work, env=env(RANK="1"),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=120)
    (code, out), = warm_python.run([([script, "a", "b"], env(RANK="1"))], work, str(tmp_path), 120)
    assert (code, out) == (fresh.returncode, fresh.stdout) == (0, out)
    facts = json.loads(out.splitlines()[0])
    assert facts["name"] == "__main__" and facts["argv"] == [script, "a", "b"] and facts["main"]
    assert facts["path"][:3] == [os.path.dirname(script), os.path.join(work, "rel"), work]
    assert (facts["cwd"], facts["rank"], facts["stdin"]) == (work, "1", "")
    assert "atexit ran" in out and "unflushed at exit" in out


@pytest.mark.parametrize("code, want", [
    ("raise SystemExit(3)", 3),
    ("import sys; sys.exit('a message')", 1),
    ("raise ValueError('boom')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
])
def test_exit_codes_and_tracebacks_are_a_fresh_interpreters(tmp_path, code, want):
    script = tmp_path / "s.py"
    script.write_text(code + "\n")
    fresh = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
    (got, out), = warm_python.run([([str(script)], env())], tmp_path, str(tmp_path), 120)
    assert got == fresh.returncode == want
    assert out.splitlines()[-1:] == fresh.stdout.splitlines()[-1:]  # the message, or the exception's last line


def test_scripts_of_one_call_run_at_once_and_a_deadline_kills_them(tmp_path):
    # each waits for the other's file: only scripts running at the same time both finish
    wait = ("import os, sys, time\nopen(sys.argv[1], 'w').close()\n"
            "while not os.path.exists(sys.argv[2]): time.sleep(0.01)\n")
    script = tmp_path / "wait.py"
    script.write_text(wait)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    jobs = [([str(script), a, b], env(RANK="0")), ([str(script), b, a], env(RANK="1"))]
    assert [code for code, _ in warm_python.run(jobs, tmp_path, str(tmp_path), 120)] == [0, 0]
    script.write_text("import os\nprint(os.getpid(), flush=True)\nimport time\ntime.sleep(600)\n")
    with pytest.raises(TimeoutError):
        warm_python.run([([str(script)], env())], tmp_path, str(tmp_path), 2)
    pid = int((tmp_path / "script0.out").read_text().split()[0])
    assert not os.path.exists(f"/proc/{pid}"), "the script outlived its deadline"
    missing = str(tmp_path / "missing.py")  # and the zygote still serves
    fresh = subprocess.run([sys.executable, missing], env=env(), capture_output=True, text=True, timeout=120)
    assert warm_python.run([([missing], env())], tmp_path, str(tmp_path), 120) == [(fresh.returncode, fresh.stderr)]


def test_scripts_of_one_call_share_their_environment(tmp_path):
    with pytest.raises(ValueError, match="share their environment"):
        warm_python.run([(["x.py"], env()), (["x.py"], env(PROBE="other"))], tmp_path, str(tmp_path), 10)
