"""Hostfiles read as DeepSpeed's launcher reads them (ds_ext/topology/hostfile.py):
the pool equals DeepSpeed's own parser's and every line DeepSpeed refuses is refused
with the file and line named; --include / --exclude / --num_nodes / --num_gpus give
DeepSpeed's own active resources; ``topology.bandwidth: hostfile`` follows the
launcher's --world_info (read from the parent, checked here under the real
``deepspeed`` launcher with --include, which gives fewer ranks than the hostfile's slots), or the
section's filters, and a mismatch names what differs; the planner's --hostfile with
the same flags. Single process plus one real launcher run; about 10 s."""

import json
import os
import subprocess
import sys

import pytest
from deepspeed.launcher import runner

from ds_ext.config import TopologySection
from ds_ext.distributed import free_port
from ds_ext.errors import ConfigError
from ds_ext.topology import hostfile as hf
from ds_ext.topology.setup import bandwidth_matrix, hostfile_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOSTS = """\
# three nodes; the last is smaller
worker-0 slots=4
   worker-1    slots=4   # trailing text is ignored, as DeepSpeed's launcher ignores it

worker-2 slots=2
"""


def _section(tmp_path, text=HOSTS, **filters):
    path = tmp_path / "hosts"
    path.write_text(text)
    section = TopologySection(bandwidth="hostfile", hostfile=str(path), **filters)
    section.check("seekspeed.topology")
    return section


def test_pool_is_deepspeeds():
    pool = hf.parse_hostfile(HOSTS, path="hosts")
    assert list(pool.items()) == [("worker-0", 4), ("worker-1", 4), ("worker-2", 2)]
    assert pool == runner._parse_hostfile(HOSTS.splitlines(keepends=True))


@pytest.mark.parametrize("text, message", [
    ("a slots=8\nworker-2 slots=eight\n", "hosts:2: 'worker-2 slots=eight': slots must be an integer"),
    ("a slots=8\n# b\nb slots=2\na slots=4\n", "hosts:4: 'a slots=4': host a is already listed on line 1"),
    ("a slots = 8\n", "hosts:1: 'a slots = 8': write slots=N with no spaces"),
    ("a slots=-1\n", "hosts:1: 'a slots=-1': slots must be >= 0"),
    ("a slots=8\n\nb\n", "hosts:3: 'b': expected 'host slots=N' \\(no slots="),
    ("a 8\n", "hosts:1: 'a 8': expected 'host slots=N'"),
    ("# only a comment\n\n", "hosts: no hosts"),
])
def test_bad_lines_name_the_file_and_line_and_deepspeed_refuses_them_too(text, message):
    with pytest.raises(ConfigError, match=message):
        hf.parse_hostfile(text, path="hosts")
    with pytest.raises(ValueError):
        runner._parse_hostfile(text.splitlines(keepends=True))


def test_filters_are_deepspeeds():
    pool = hf.parse_hostfile(HOSTS, path="hosts")
    assert hf.active_resources(pool, path="hosts") == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3],
                                                       "worker-2": [0, 1]}
    # include keeps the hostfile's order, not the include string's
    assert hf.active_resources(pool, include="worker-2@worker-0:1,3", path="hosts") == {"worker-0": [1, 3],
                                                                                       "worker-2": [0, 1]}
    assert hf.active_resources(pool, exclude="worker-1@worker-0:0", path="hosts") == {"worker-0": [1, 2, 3],
                                                                                     "worker-2": [0, 1]}
    assert hf.active_resources(pool, num_nodes=2, path="hosts") == {"worker-0": [0, 1, 2, 3],
                                                                    "worker-1": [0, 1, 2, 3]}
    assert hf.active_resources(pool, num_gpus=1, path="hosts") == {h: [0] for h in pool}


@pytest.mark.parametrize("filters, message", [
    ({"include": "worker-9"}, "--include 'worker-9' with hosts: Hostname 'worker-9' not found"),
    ({"include": "worker-2:2"}, "No slot '2' specified on host 'worker-2'"),
    ({"exclude": "worker-0:x"}, "--exclude 'worker-0:x' with hosts: invalid literal"),
    ({"include": "worker-0", "exclude": "worker-1"}, "--include and --exclude are mutually exclusive"),
    ({"include": "worker-0", "num_nodes": 1}, "--num_nodes cannot be combined with --include"),
    ({"exclude": "worker-0@worker-1@worker-2"}, "leaves no slots of hosts"),
])
def test_bad_filters(filters, message):
    with pytest.raises(ConfigError, match=message):
        hf.active_resources(hf.parse_hostfile(HOSTS, path="hosts"), path="hosts", **filters)


def test_world_info_only_from_deepspeeds_launcher():
    info = {"worker-1": [0, 2]}
    encoded = runner.encode_world_info(info)
    assert hf.launcher_world_info([sys.executable, "-u", "-m", "deepspeed.launcher.launch",
                                   f"--world_info={encoded}", "--node_rank=0"]) == info
    assert hf.launcher_world_info([sys.executable, "train.py", f"--world_info={encoded}"]) is None
    assert hf.launcher_world_info([sys.executable, "-m", "torch.distributed.run", "train.py"]) is None


def test_include_launch_follows_the_launcher(tmp_path):
    """`deepspeed --hostfile hosts --include worker-1 ...` runs 4 ranks on a 10-slot
    hostfile: the nodes are those the launcher chose, not the hostfile's whole pool."""
    section = _section(tmp_path)
    nodes, source = hostfile_nodes(section, world_size=4, world_info={"worker-1": [0, 1, 2, 3]},
                                   env={"CROSS_SIZE": "1", "CROSS_RANK": "0", "LOCAL_SIZE": "4"})
    assert nodes == [4] and "as DeepSpeed's launcher chose" in source
    nodes, _ = hostfile_nodes(section, world_size=5, world_info={"worker-0": [0, 2, 3], "worker-2": [0, 1]},
                              env={"CROSS_SIZE": "2", "CROSS_RANK": "1", "LOCAL_SIZE": "2"})
    assert nodes == [3, 2]


def test_without_the_launchers_choice_the_section_filters(tmp_path, monkeypatch):
    for name in ("CROSS_SIZE", "CROSS_RANK", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as err:
        bandwidth_matrix(_section(tmp_path), world_size=4, log=print)
    msg = str(err.value)
    assert "3 hosts (worker-0: 4, worker-1: 4, worker-2: 2) = 10 slots" in msg and "started 4 ranks" in msg
    assert "seekspeed.topology.include" in msg and "bandwidth to \"launcher\"" in msg
    m = bandwidth_matrix(_section(tmp_path, include="worker-1@worker-2"), world_size=6, log=print)
    assert m.ranks == 6 and m.affinity_groups() == [[0, 1, 2, 3], [4, 5]]
    m = bandwidth_matrix(_section(tmp_path, num_nodes=2, num_gpus=2), world_size=4, log=print)
    assert m.affinity_groups() == [[0, 1], [2, 3]]


def test_mismatches_name_what_differs(tmp_path):
    section = _section(tmp_path, include="worker-0")
    with pytest.raises(ConfigError, match="include 'worker-0' gives 1 host .* but DeepSpeed's launcher started "
                                          "1 host \\(worker-1: 4\\)"):
        hostfile_nodes(section, world_size=4, world_info={"worker-1": [0, 1, 2, 3]}, env={})
    with pytest.raises(ConfigError, match="started ranks on worker-7, which seekspeed.topology.hostfile"):
        hostfile_nodes(_section(tmp_path), world_size=4, world_info={"worker-7": [0, 1, 2, 3]}, env={})
    with pytest.raises(ConfigError, match="started 3 nodes \\(CROSS_SIZE\\)"):
        hostfile_nodes(_section(tmp_path, include="worker-0@worker-1:0,1,2"), world_size=7, env={"CROSS_SIZE": "3"})
    with pytest.raises(ConfigError, match="gives worker-1 2 slots, but the launcher started 4 ranks on node 1 "
                                          "\\(LOCAL_SIZE\\)"):
        hostfile_nodes(_section(tmp_path, include="worker-0:0,1@worker-1:0,1"), world_size=4,
                       env={"CROSS_SIZE": "2", "CROSS_RANK": "1", "LOCAL_SIZE": "4"})


def test_section_filters_need_the_hostfile_source():
    with pytest.raises(ConfigError, match="seekspeed.topology.include filters the hostfile, but "
                                          "seekspeed.topology.bandwidth is 'launcher'"):
        TopologySection(include="worker-0").check("seekspeed.topology")
    with pytest.raises(ConfigError, match="num_gpus must be >= 1"):
        TopologySection(bandwidth="hostfile", hostfile="hosts", num_gpus=0).check("seekspeed.topology")


PROBE = """\
import json, os
from ds_ext.topology.hostfile import launcher_world_info
env = {k: os.environ[k] for k in ("WORLD_SIZE", "CROSS_SIZE", "CROSS_RANK", "LOCAL_SIZE")}
with open(f"probe-{os.environ['RANK']}.json", "w") as f:
    json.dump({"world_info": launcher_world_info(), "env": env}, f)
"""


@pytest.mark.e2e
def test_real_launcher_with_include(tmp_path):
    """`deepspeed --hostfile hosts --include worker-1:1,3` (no ssh: this node is node 0):
    the rank reads the launcher's choice from its parent and the matrix is built."""
    section = _section(tmp_path)
    (tmp_path / "probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu")
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", section.hostfile,
                           "--include", "worker-1:1,3", "--no_ssh", "--node_rank", "0", "--master_addr", "127.0.0.1",
                           "--master_port", str(port), str(tmp_path / "probe.py")],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    written = sorted(p.name for p in tmp_path.glob("probe-*.json"))
    assert proc.returncode == 0 and written == ["probe-0.json", "probe-1.json"], proc.stdout[-3000:] + proc.stderr
    seen = json.loads((tmp_path / "probe-0.json").read_text())
    assert json.loads((tmp_path / "probe-1.json").read_text()) == seen          # both ranks of the node
    assert seen["world_info"] == {"worker-1": [1, 3]}
    assert seen["env"] == {"WORLD_SIZE": "2", "CROSS_SIZE": "1", "CROSS_RANK": "0", "LOCAL_SIZE": "2"}
    nodes, _ = hostfile_nodes(section, world_size=2, world_info=seen["world_info"], env=seen["env"])
    assert nodes == [2]


def test_planner_hostfile_flags(tmp_path):
    from ds_ext.planner import nodes_from_hostfile
    from launch.plan import main
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"node-{i:03d} slots=8\n" for i in range(4)) + "small slots=4\n")
    assert nodes_from_hostfile(str(hosts), include="node-001@node-003") == (2, 8)
    assert nodes_from_hostfile(str(hosts), num_nodes=3) == (3, 8)
    assert nodes_from_hostfile(str(hosts), exclude="small") == (4, 8)
    assert nodes_from_hostfile(str(hosts), num_gpus=4) == (5, 4)
    with pytest.raises(ConfigError, match="different GPU counts \\(4 GPUs on small; 8 GPUs on node-000, node-001, "
                                          "node-002, ...\\)"):
        nodes_from_hostfile(str(hosts))
    with pytest.raises(ConfigError, match=f"{hosts}:1: 'node-000 slots=eight': slots must be an integer"):
        hosts.write_text("node-000 slots=eight\n")
        nodes_from_hostfile(str(hosts))
    config = os.path.join(ROOT, "ds_configs", "tiny_cpu.json")
    assert main(["--deepspeed", config, "--include", "node-000"]) == 2
    hosts.write_text("a slots=2\nb slots=2\nc slots=2\n")
    out = tmp_path / "plan.json"
    assert main(["--deepspeed", config, "--hostfile", str(hosts), "-i", "b", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["nodes"], figures["ranks_per_node"]) == (1, 2)
