"""The sandbox's per-run cgroups and interpreter folders: what is written where, what is reported
when a limit cannot be enforced, and which interpreter folders the private tmpfs would hide."""

import os
import sys

import pytest

from agentloop_tools.builtin import _sandbox_cgroup as cgroups
from agentloop_tools.builtin import _sandbox_interpreter as interpreter
from agentloop_tools.builtin.sandbox import PythonSandboxTool, SandboxLimits, run_python


def _fake_v2(tmp_path, name, subtree="memory pids", files=("cgroup.kill", "memory.max", "memory.swap.max",
                                                              "pids.max")):
    """A folder laid out like a delegated cgroup v2 parent with the run's cgroup already in it
    (mkdir in a real cgroupfs fills in these files; here they are made by hand)."""
    (tmp_path / "cgroup.subtree_control").write_text(subtree)
    (tmp_path / "cgroup.controllers").write_text("memory pids")
    run = tmp_path / name
    run.mkdir()
    for f in files:
        (run / f).write_text("max")
    return run


def test_v2_parent_with_the_controllers_gets_memory_swap_and_pids_limits(tmp_path):
    run_dir = _fake_v2(tmp_path, "run-1")
    run = cgroups.create("run-1", 160 * 2**20, 16, parent=str(tmp_path))
    assert run.kill_dir == str(run_dir)
    assert run.memory == ("v2", str(run_dir))
    assert run.pids == ("v2", str(run_dir))
    assert (run_dir / "memory.max").read_text() == str(160 * 2**20)
    assert (run_dir / "memory.swap.max").read_text() == "0"
    assert (run_dir / "pids.max").read_text() == "16"
    assert run.unenforced == []
    assert run.procs_files() == [str(run_dir / "cgroup.procs")]


def test_v2_parent_without_the_controllers_reports_each_limit_and_the_fix(tmp_path):
    _fake_v2(tmp_path, "run-2", subtree="", files=("cgroup.kill",))
    (tmp_path / "cgroup.controllers").write_text("cpu io")  # neither memory nor pids to hand out
    run = cgroups.create("run-2", 2**30, 64, parent=str(tmp_path))
    assert run.kill_dir is not None
    assert run.memory is None
    assert run.pids is None
    assert len(run.unenforced) == 2
    memory, pids = run.unenforced
    assert memory.startswith("run_memory_mb is not enforced per run")
    assert "does not have the memory controller" in memory
    assert pids.startswith("max_processes is not enforced per run")
    assert all("set cgroup_parent" in reason for reason in run.unenforced)


def test_a_parent_that_is_no_cgroup_gives_no_kill_cgroup_and_says_why(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("")
    run = cgroups.create("run-3", 2**30, 64, parent=str(tmp_path))
    assert run.kill_dir is None
    assert not (tmp_path / "run-3").exists()  # the plain folder it made is removed again
    assert [r.split(" (")[0] for r in run.unenforced] == ["run_memory_mb is not enforced per run",
                                                          "max_processes is not enforced per run"]


async def test_where_no_limit_can_be_set_the_run_still_works_and_the_result_says_so(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("")
    res = await run_python("print('ok')", SandboxLimits(cgroup_parent=str(tmp_path)))
    assert res.stdout == "ok\n", res.stderr
    assert "cgroup-memory" not in res.isolation
    assert "cgroup-pids" not in res.isolation
    assert any(r.startswith("run_memory_mb is not enforced") for r in res.unenforced), res.unenforced
    assert res.memory_peak_bytes is None


def test_per_run_limits_are_tool_config_keys(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("")
    tool = PythonSandboxTool({"run_memory_mb": 300, "max_processes": 9, "cgroup_parent": str(tmp_path)})
    assert tool.limits.run_memory_mb == 300
    assert tool.limits.max_processes == 9
    assert tool.limits.cgroup_parent == str(tmp_path)
    with pytest.raises(ValueError, match="run_memory_mb must be a positive number"):
        PythonSandboxTool({"run_memory_mb": 0})
    with pytest.raises(ValueError, match="cgroup_parent must be the absolute path of a cgroup v2 folder"):
        PythonSandboxTool({"cgroup_parent": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="cgroup_parent must be"):
        PythonSandboxTool({"cgroup_parent": "relative/cg"})


# ---- interpreter folders under the masks --------------------------------------------------------


def test_hidden_paths_keep_the_outermost_folder_under_a_mask(tmp_path):
    mask = tmp_path / "tmp"
    venv = mask / "venv"
    (venv / "lib" / "site-packages").mkdir(parents=True)
    (venv / "bin").mkdir()
    outside = tmp_path / "usr"
    outside.mkdir()
    paths = [str(venv / "bin"), str(venv), str(venv / "lib" / "site-packages"), str(outside), "", "rel/x",
             str(mask / "python311.zip")]  # a zip entry that does not exist
    assert interpreter.hidden_paths(paths, masks=(str(mask),)) == (str(venv),)


def test_hidden_paths_follow_a_symlink_into_a_mask(tmp_path):
    mask = tmp_path / "tmp"
    (mask / "real").mkdir(parents=True)
    link = tmp_path / "opt-python"
    link.symlink_to(mask / "real")
    assert interpreter.hidden_paths([str(link)], masks=(str(mask),)) == (str(mask / "real"),)


def test_an_interpreter_that_needs_a_masked_folder_itself_is_refused_naming_the_fix(tmp_path):
    mask = tmp_path / "tmp"
    mask.mkdir()
    with pytest.raises(ValueError, match="needs .* itself, which the private tmpfs hides.*private_tmp: false"):
        interpreter.hidden_paths([str(mask)], masks=(str(mask),))


def test_masked_paths_of_a_broken_interpreter_name_python_executable(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="does not start .*python_executable"):
        interpreter.masked_paths(str(fake), site=False)


def test_the_installed_interpreter_needs_nothing_from_tmp_unless_it_lives_there():
    import sys

    hidden = interpreter.masked_paths(sys.executable, site=True)
    assert all(p.startswith(("/tmp/", "/var/tmp/", "/dev/shm/")) for p in hidden), hidden
    if not os.path.realpath(sys.prefix).startswith(("/tmp/", "/var/tmp/")):
        assert not any(os.path.realpath(sys.prefix).startswith(p) for p in hidden)


def test_the_file_view_shows_the_interpreters_folders_and_never_a_whole_shared_one(tmp_path, monkeypatch):
    from agentloop_tools.builtin import _sandbox_rootfs as rootfs

    view = interpreter.file_view(sys.executable, False, rootfs.SYSTEM_DIRS)
    real = os.path.realpath(sys.executable)
    assert [b for b in view["binds"] if real.startswith(b + "/")], view  # the interpreter itself is shown
    assert "/" not in view["binds"]
    asked = (["/usr/bin", "/tmp"], [])  # an interpreter with /tmp on its sys.path (a .pth file)
    monkeypatch.setitem(interpreter._asked, ("/fake/python", False), asked)
    with pytest.raises(ValueError, match="isolate_files would have to show whole.*isolate_files: false"):
        interpreter.file_view("/fake/python", False, rootfs.SYSTEM_DIRS)
