"""The local cluster harness (pgq.localcluster) when a node does not come up:
the failure says why (the node's log), and a cluster start survives one bad
start of a node while saying so (a StartRetried warning)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from pgq.localcluster import LocalCluster, StartRetried

# The launcher of the test node: its first start exits at once, as a node
# whose bus address was taken would; the next ones run the CLI.
FLAKY = textwrap.dedent("""
    import runpy, sys
    from pathlib import Path
    marker = Path(sys.argv[1])
    if not marker.exists():
        marker.write_text("failed once")
        print("first start refused on purpose", flush=True)
        sys.exit(3)
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
""")


@pytest.fixture
def one_node():
    """A one-node harness cluster whose node the test starts itself; closed
    (every process it started stopped) whatever the test did."""
    cluster = LocalCluster(1, prefix="pgq-harness-")
    try:
        yield cluster, cluster.nodes[0]
    finally:
        cluster.close()


def test_a_node_that_exits_is_reported_with_its_log_and_started_once_more(one_node):
    cluster, node = one_node
    script = cluster.root / "flaky.py"
    script.write_text(FLAKY)
    node.launcher = [sys.executable, str(script), str(cluster.root / "failed-once"), "pgq.cli"]
    node.start()
    # 600 s: far beyond any start here, so only the exit's detection (not
    # the wait running out) can produce the "exited" message below.
    with pytest.warns(StartRetried) as warned:
        node.serve_or_restart(600)
    message = str(warned[0].message)
    assert "n1's process exited with status 3 before serving" in message
    assert "first start refused on purpose" in message
    assert node.serving() and node.alive()


def test_a_node_that_exits_twice_fails_the_start_with_its_log(one_node):
    _cluster, node = one_node
    node.launcher = [sys.executable, "-c", "print('refusing every start'); raise SystemExit(4)"]
    node.start()
    with pytest.warns(StartRetried), pytest.raises(RuntimeError) as failed:
        node.serve_or_restart(600)
    assert "exited with status 4" in str(failed.value)
    assert "refusing every start" in str(failed.value)


def test_a_running_node_is_not_started_twice(one_node):
    # A second start would replace the handle of the first process, which
    # close() then could not stop (a script that entered `with LocalCluster`
    # and called start() again left three node processes running).
    cluster, node = one_node
    node.launcher = [sys.executable, "-c", "import time; time.sleep(120)"]
    node.start()
    first = node.process
    with pytest.raises(RuntimeError, match="runs already"):
        node.start()
    assert node.process is first and node.alive()
    cluster.close()
    assert first is not None and first.poll() is not None  # close() stopped it


def test_kill_postgres_leaves_a_process_that_took_a_stale_pid_alone(tmp_path):
    # postmaster.pid outlives a killed server, and its pid may belong to
    # another process since: kill_postgres signalled whatever had it.
    import signal
    import subprocess

    from pgq.localcluster import LocalNode

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        node = LocalNode("n1", tmp_path / "n1", 7999, tmp_path / "secret", None)
        data = node.postgres / "data"
        data.mkdir(parents=True)
        (data / "postmaster.pid").write_text(f"{other.pid}\n{data}\n1764000000\n5432\n/tmp\n*\n  1 2\nready\n")
        assert node.postmaster_pid() is None and not node.postgres_running()
        assert node.kill_postgres(signal.SIGKILL) is False
        assert other.poll() is None  # still running
    finally:
        other.kill()
        other.wait(10)
