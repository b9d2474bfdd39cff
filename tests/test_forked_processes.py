"""tests/support/processes.py: a child forked from the fork server behaves, seen from outside,
like the same command started as a new interpreter; and what it cannot stand in for starts as one.

Each behaviour is checked against `subprocess` running the same command for real, so the
comparison is with Python itself, not with what this file expects Python to do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support import processes

PY = sys.executable


def both(args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The command forked from the fork server, and the same command run by subprocess."""
    forked = processes.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    real = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120, **kwargs)
    return forked, real


def test_exit_codes_stdout_stderr_and_tracebacks_match_python(tmp_path: Path) -> None:
    cases = {
        "returns": "print('out'); import sys; print('err', file=sys.stderr)",
        "exits 3": "import sys; print('bye'); sys.exit(3)",
        "exits with a message": "import sys; sys.exit('a message')",
        "raises": "raise ValueError('the reason')",
        "exits 0 from a finally": "try:\n    raise KeyError(1)\nfinally:\n    import os; os._exit(0)",
    }
    for name, code in cases.items():
        with processes.Popen([PY, "-c", code], stdout=subprocess.PIPE) as probe:
            probe.communicate(timeout=120)
        assert probe.forked, name
        forked, real = both([PY, "-c", code])
        assert forked.returncode == real.returncode, name
        assert forked.stdout == real.stdout, name
        # A traceback's last line is the same; its first frames are the fork server's.
        assert forked.stderr.strip().splitlines()[-1:] == real.stderr.strip().splitlines()[-1:], name


def test_argv_path_directory_environment_and_stdin(tmp_path: Path) -> None:
    script = tmp_path / "tool" / "show.py"
    script.parent.mkdir()
    (script.parent / "helper_beside_it.py").write_text("VALUE = 'beside'\n")
    script.write_text(
        "import os, sys\n"
        "from helper_beside_it import VALUE\n"  # the script's folder is sys.path[0]
        "print(sys.argv[1:], VALUE, os.getcwd(), os.environ.get('TINKER_PROBE'), input())\n"
    )
    env = {**os.environ, "TINKER_PROBE": "set"}
    forked, real = both([PY, str(script), "a", "b"], cwd=tmp_path, env=env, input="typed\n")
    assert real.returncode == 0, real.stderr
    assert forked.stdout == real.stdout == f"['a', 'b'] beside {tmp_path} set typed\n"

    module = [PY, "-m", "json.tool", "--compact"]  # -m: a module run as __main__
    forked, real = both(module, input='{"a": [1, 2]}')
    assert forked.returncode == real.returncode == 0
    assert forked.stdout == real.stdout == '{"a":[1,2]}\n'
    assert "RuntimeWarning" not in forked.stderr  # not "found in sys.modules" for a preloaded one


def test_a_temporary_folder_of_its_own_is_the_one_a_forked_child_uses(tmp_path: Path) -> None:
    """TMPDIR: the fork server forgot the folder its imports asked for (zygote.py), so the
    child's `tempfile` finds the child's own, as a new interpreter's does."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    code = ("import tempfile; made = tempfile.mkdtemp(); "
            "print(tempfile.gettempdir(), made.startswith(tempfile.gettempdir() + '/'))")
    env = {**os.environ, "TMPDIR": str(folder)}
    with processes.Popen([PY, "-c", code], env=env, stdout=subprocess.PIPE, text=True) as child:
        out, _ = child.communicate(timeout=60)
    assert child.forked and child.returncode == 0
    real = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    assert out == real.stdout == f"{folder} True\n"


def test_atexit_handlers_and_threads_finish_before_the_exit(tmp_path: Path) -> None:
    code = (
        "import atexit, threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "ThreadPoolExecutor(1).submit(lambda: (time.sleep(0.6), print('pool done')))\n"
    )
    forked, real = both([PY, "-c", code])
    assert forked.returncode == real.returncode == 0
    assert sorted(forked.stdout.splitlines()) == sorted(real.stdout.splitlines())
    assert "atexit ran" in forked.stdout and "pool done" in forked.stdout


def test_signals_end_it_as_they_end_python() -> None:
    sleeper = [PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        codes = []
        for start in (processes.Popen, subprocess.Popen):
            proc = start(sleeper, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert proc.stdout.readline() == "ready\n"
            proc.send_signal(sig)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                # Say which case and where the child sits. Seen when the whole run had SIGINT
                # ignored (a background job of a shell without job control: SigIgn shows it),
                # which tests/conftest.py now undoes.
                state = _where_it_waits(proc.pid)
                proc.kill()
                pytest.fail(f"{sig!r} did not end a child started by {start.__module__}."
                            f"Popen (forked: {getattr(proc, 'forked', False)}):\n{state}")
            codes.append(proc.returncode)
        assert codes[0] == codes[1] == -sig, (sig, codes)


def _where_it_waits(pid: int) -> str:
    """The signal masks and state of a process, and its Python stack when py-spy is installed."""
    proc_dir = Path(f"/proc/{pid}")
    status = (proc_dir / "status").read_text() if proc_dir.exists() else "(gone)"
    lines = [ln for ln in status.splitlines() if ln.startswith(("State", "Sig", "Shd", "Threads"))]
    py_spy = Path(sys.executable).with_name("py-spy")
    if py_spy.exists():
        dump = subprocess.run([str(py_spy), "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=30, check=False)  # fmt: skip
        lines.append(dump.stdout + dump.stderr)
    return "\n".join(lines)


def test_poll_wait_timeout_and_a_new_session() -> None:
    proc = processes.Popen(
        [PY, "-c", "import os, time; print(os.getsid(0) == os.getpid(), flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.forked
    assert proc.stdout.readline() == "True\n"  # its own session, so a killpg reaches only it
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run([PY, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_each_child_has_its_own_random_state() -> None:
    code = "import random, numpy, torch; print(random.random(), numpy.random.rand(), torch.rand(1).item())"
    first, second = (processes.run([PY, "-c", code], capture_output=True, text=True) for _ in range(2))
    assert first.returncode == second.returncode == 0
    assert first.stdout != second.stdout
    assert all(a != b for a, b in zip(first.stdout.split(), second.stdout.split()))


def _importing_nothing(started: type) -> Callable[..., object]:
    """processes._ForkServer, with nothing preloaded whatever it is asked for (these tests'
    children import nothing heavy)."""

    def start(preload: str = processes.FULL, **kwargs: object) -> object:
        return started(preload=processes.NOTHING, **kwargs)

    return start


def test_what_the_fork_server_cannot_stand_in_for_starts_a_new_interpreter(tmp_path: Path) -> None:
    # torch reads it at import, and both fork servers have imported torch.
    import_time_setting = {**os.environ, "OMP_NUM_THREADS": "3"}
    not_python = ["sh", "-c", "exit 4"]
    cases = [
        ([PY, "-c", "pass"], {"fresh": True}),
        ([PY, "-c", "pass"], {"env": import_time_setting}),
        ([PY, "-X", "dev", "-c", "pass"], {}),
        ([PY, "-c", "pass"], {"preexec_fn": lambda: None}),
        (not_python, {}),
    ]
    for args, kwargs in cases:
        proc = processes.Popen(args, **kwargs)
        assert not proc.forked, (args, kwargs)
        assert proc.wait(60) == (4 if args is not_python else 0)
    # A variable read while the code runs (not at import) keeps the fork.
    runtime_setting = {**os.environ, "TINKER_BASE_URL": "http://127.0.0.1:9"}
    with processes.Popen([PY, "-c", "pass"], env=runtime_setting) as proc:
        assert proc.forked and proc.wait(60) == 0


HUB_SETTINGS = """
import os, sys
before = [m for m in ("huggingface_hub", "transformers", "tokenizers", "peft") if m in sys.modules]
from huggingface_hub import constants
print(before, constants.HF_HOME, constants.ENDPOINT, "torch" in sys.modules)
"""


def test_a_child_with_a_hub_of_its_own_is_forked_from_the_server_without_the_hf_libraries(
    tmp_path: Path,
) -> None:
    """A HF_HOME or HF_ENDPOINT of its own (a recipe's cache, a fake hub): the first fork server
    has imported huggingface_hub, which read the suite's; the child is forked from the one that
    has not, and reads its own, as a new interpreter does."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    with processes.Popen([PY, "-c", HUB_SETTINGS + "print(os.getppid())"], env=env,
                         stdout=subprocess.PIPE, text=True) as child:  # fmt: skip
        out, _ = child.communicate(timeout=120)
    assert child.forked and child.returncode == 0
    settings, parent = out.splitlines()
    assert int(parent) == processes._fork_server(processes.WITHOUT_HF).pid
    real = subprocess.run([PY, "-c", HUB_SETTINGS], env=env, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert settings == f"[] {tmp_path / 'hf'} http://127.0.0.1:9 True"
    assert real.stdout == settings.replace("True", "False") + "\n"  # the fork has torch already


def test_a_forked_child_starts_with_the_heavy_imports_done() -> None:
    """Why the fork server exists: torch, transformers and peft are imported once, not per child
    (5-7 s of CPU each). A new interpreter starts without them."""
    code = "import sys; print(all(m in sys.modules for m in ('torch', 'transformers.modeling_utils', 'peft')))"
    forked, real = both([PY, "-c", code])
    assert (forked.stdout, real.stdout) == ("True\n", "False\n")


def test_a_child_whose_fork_server_died_has_no_made_up_exit_code(monkeypatch) -> None:
    """If the fork server goes away first, nothing reports how the child ended: waiting says
    so instead of returning a code a test could take for the child's."""
    # A fork server of this test's own: this worker's may have children alive (`served`). It
    # and the one that replaces it skip the heavy imports, which these children do not need.
    light = _importing_nothing(processes._ForkServer)
    monkeypatch.setattr(processes, "_ForkServer", light)
    server = light()
    monkeypatch.setitem(processes._servers, processes.FULL, server)
    proc = processes.Popen([PY, "-c", "import time; time.sleep(60)"])
    assert proc.forked
    server.process.kill()
    server.process.wait(60)
    with pytest.raises(ChildProcessError, match="exit status is unknown"):
        proc.wait(60)
    os.kill(proc.pid, signal.SIGKILL)  # the orphan, now init's child
    # The next process gets a new fork server.
    with processes.Popen([PY, "-c", "pass"]) as after:
        assert after.forked and after.wait(60) == 0


GRANDCHILDREN = """
import os, subprocess, sys
ppid = [sys.executable, "-c", "import os; print(os.getppid())"]
python = subprocess.run(ppid, capture_output=True, text=True, check=True).stdout.strip()
fresh_env = {**os.environ, "HF_HOME": sys.argv[1]}
fresh = subprocess.run(ppid, capture_output=True, text=True, env=fresh_env, check=True)
code = subprocess.run([sys.executable, "-c", "import sys; sys.exit(5)"]).returncode
# A grandchild's own child (the next generation).
nested = f"import subprocess, sys; subprocess.run({ppid!r})"
grandchild = subprocess.run([sys.executable, "-c", nested], capture_output=True, text=True, check=True)
# A rank, as torch's elastic agent starts one (with the variables it sets).
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
rank = SubprocessHandler(sys.executable, tuple(ppid[1:]), {"RANK": "1", "TORCHELASTIC_RUN_ID": "r"},
                         stdout=sys.argv[2], stderr=None, local_rank_id=1, numa_options=None)
rank.proc.wait()
with open(sys.argv[2]) as written:
    print(os.getpid(), python, fresh.stdout.strip(), code, written.read().strip(),
          grandchild.stdout.strip())
"""


def test_a_child_may_fork_its_own_python_children_from_the_fork_server(tmp_path: Path) -> None:
    """`fork_descendants=True` (a benchmark script's server and clients): the child's own
    `python -c` children, a rank torch's elastic agent starts, and their children, are forked
    from the fork server too, by the same rules; a child that needs a new interpreter still gets
    one, and the fork server outlives the child."""
    zygote = processes._fork_server().pid
    args = [PY, "-c", GRANDCHILDREN, str(tmp_path / "another-hf-home"), str(tmp_path / "rank.out")]
    with processes.Popen(args, stdout=subprocess.PIPE, text=True, fork_descendants=True) as child:
        out, _ = child.communicate(timeout=120)
    assert child.forked and child.returncode == 0
    pid, python_parent, fresh_parent, code, rank_parent, next_parent = map(int, out.split())
    assert (python_parent, fresh_parent, code, rank_parent) == (zygote, pid, 5, zygote)
    assert next_parent == zygote
    # Without it, the child's children are its own, as a new interpreter's would be.
    plain = processes.run(args, capture_output=True, text=True, timeout=120, check=True)
    pid, python_parent, _, _, rank_parent, next_parent = plain.stdout.split()
    assert python_parent == rank_parent == pid and int(next_parent) != zygote
    # The fork server is still there for the test process.
    with processes.Popen([PY, "-c", "pass"]) as after:
        assert after.forked and after.wait(60) == 0
    assert processes._fork_server().pid == zygote


def test_the_xdist_workers_share_the_fork_servers_their_controller_started(monkeypatch) -> None:
    """The controller starts the fork servers, each listening on a socket it names in the
    environment (tests/conftest.py); a worker connects to them instead of starting its own,
    forks its children there, and starts its own when one has gone."""
    started = processes._ForkServer
    monkeypatch.setattr(processes, "_ForkServer", _importing_nothing(started))
    monkeypatch.setattr(processes, "_servers", {})
    for variable in processes.SHARED_FORK_SERVER_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    processes.start_shared_fork_server()  # as the controller does
    controller = dict(processes._servers)
    assert sorted(controller) == sorted(processes.SHARED_FORK_SERVER_ENV)
    monkeypatch.setattr(processes, "_servers", {})  # a worker: it has no fork server yet
    for kind, server in controller.items():
        shared = processes._fork_server(kind)
        assert not isinstance(shared, started) and shared.pid == server.process.pid
    ppid = [PY, "-c", "import os; print(os.getppid())"]
    forked = processes.run(ppid, capture_output=True, text=True, timeout=60, check=True)
    assert int(forked.stdout) == controller[processes.FULL].process.pid
    for server in controller.values():  # the run ends (or they died): the worker starts its own
        server.close()
    own = processes._fork_server()
    assert isinstance(own, started) and own.pid != controller[processes.FULL].process.pid
    forked = processes.run(ppid, capture_output=True, text=True, timeout=60, check=True)
    assert int(forked.stdout) == own.pid
    own.close()
    for variable in processes.SHARED_FORK_SERVER_ENV.values():
        assert not Path(os.environ[variable]).parent.exists()


def test_xdist_workers_are_forked_by_the_python_the_suite_names(monkeypatch) -> None:
    """An execnet popen gateway, as xdist makes one per worker, with the python tests/conftest.py
    gives xdist (processes.forked_xdist_worker: tests/support/xdist_worker.py): the worker is
    forked from the controller's fork server, speaks execnet over its stand-in's stdin and
    stdout, and its exit is its stand-in's. Where the fork server cannot stand in, the worker
    is a new interpreter."""
    import execnet

    monkeypatch.setattr(processes, "_ForkServer", _importing_nothing(processes._ForkServer))
    monkeypatch.setattr(processes, "_servers", {})
    for variable in processes.SHARED_FORK_SERVER_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    processes.start_shared_fork_server()  # as the controller does, before xdist's workers
    server = processes._servers[processes.FULL]
    spec = processes.forked_xdist_worker("popen")
    assert spec != "popen" and processes.forked_xdist_worker("ssh=elsewhere") == "ssh=elsewhere"
    asks = "import os, sys; channel.send((os.getppid(), sys.argv, channel.receive() * 2))"
    try:
        gateway = execnet.makegateway(spec)
        channel = gateway.remote_exec(asks)
        channel.send(21)
        parent, argv, answer = channel.receive(60)
        assert (parent, argv, answer) == (server.process.pid, ["-c"], 42)
        stand_in = gateway._io.popen
        gateway.exit()
        assert stand_in.wait(60) == 0

        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read at import: no fork server has it
        gateway = execnet.makegateway(spec)
        parent = gateway.remote_exec("import os; channel.send(os.getppid())").receive(60)
        assert parent == gateway._io.popen.pid  # a new interpreter, the stand-in's child
        gateway.exit()
        assert gateway._io.popen.wait(60) == 0
    finally:
        for started in processes._servers.values():
            started.close()
