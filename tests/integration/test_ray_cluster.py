"""A run on an existing Ray cluster of two nodes (a head and a worker node joined with ``ray start
--address``, both on this machine): clients run on both nodes and the results equal a local run."""

import os
import textwrap

import pandas as pd
import pytest

from fedelastic.fl.runner import run_scenario
from fedelastic.runtime.cluster import LocalCluster
from tests.support import frames

#: a user model (small_cnn) whose forward pass writes, once per process, the Ray node it runs on
MODEL = textwrap.dedent(
    """
    import os
    from torch import nn
    from fedelastic.models.small import small_cnn

    SEEN = set()

    class Marked(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if os.getpid() not in SEEN:
                SEEN.add(os.getpid())
                import ray
                node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "none"
                with open(os.environ.get("FE_NODE_LOG", "/dev/null"), "a") as fh:
                    fh.write(f"{os.getpid()} {node}\\n")
            return self.inner(x)

    def net(**kwargs):
        return Marked(small_cnn(**kwargs))
    """
)


@pytest.mark.ray
@pytest.mark.slow
def test_a_two_node_cluster_runs_clients_on_both_nodes_and_equals_a_local_run(make_scenario, monkeypatch, tmp_path):
    (tmp_path / "marked.py").write_text(MODEL)
    log = tmp_path / "nodes.log"
    monkeypatch.setenv("FE_NODE_LOG", str(log))  # set before the nodes start: their workers inherit it
    model = {"name": str(tmp_path / "marked.py") + ":net", "options": {}}
    with LocalCluster(head_cpus=1, worker_cpus=(1,)) as cluster:
        assert len({pid for pid in cluster.processes()}) > 2  # the check below has something to find
        sim = {"backend": "ray", "ray_address": cluster.address, "num_cpus_per_client": 1, "node_mode": "per_client"}
        run_dir = run_scenario(make_scenario(model=model, simulation=sim), run_id="cluster")
        nodes = _cluster_nodes(cluster.address)
    assert cluster.processes() == {}  # stopping the cluster left none of its processes
    workers = [line.split() for line in log.read_text().splitlines() if int(line.split()[0]) != os.getpid()]
    assert {node for _, node in workers} == set(nodes) and len(nodes) == 2  # clients trained on both nodes
    local = run_scenario(make_scenario(model=model), run_id="local")
    for ours, theirs in zip(frames(run_dir), frames(local), strict=True):
        pd.testing.assert_frame_equal(ours, theirs)


def _cluster_nodes(address: str) -> list[str]:
    """The ids of the cluster's live nodes, asked from a separate process (this one's Ray is shut down)."""
    import json
    import subprocess
    import sys

    code = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR');"
        "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']])); ray.shutdown()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)  # noqa: S603
    return json.loads(out.stdout.strip().splitlines()[-1])
