"""What runs where (pipelinerl.placement) and how node launchers meet (pipelinerl.nodes, a real TCPStore)."""

import json
import threading
import time

import pytest

from pipelinerl.auth import is_loopback
from pipelinerl.config import ConfigError, RunConfig, load_config
from pipelinerl.nodes import ModelReady, NodeLost, NodeRendezvous
from pipelinerl.placement import NodeEnv, advertised_host, gpu_env, plan_node
from pipelinerl.procs import free_port


def config(*overrides: str) -> RunConfig:
    return load_config(None, ["run_dir=/tmp/x", "model.path=/tmp/m", *overrides])


def test_node_env_from_the_standard_variables():
    assert NodeEnv.from_environ({}) == NodeEnv(1, 0, "127.0.0.1", 29500)
    env = NodeEnv.from_environ({"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert env == NodeEnv(3, 2, "10.0.0.1", 1234) and env.multi_node


@pytest.mark.parametrize("environ, names", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h"}, "RANK=2"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
])
def test_node_env_errors_name_the_variable(environ, names):
    with pytest.raises(ConfigError, match=names):
        NodeEnv.from_environ(environ)


def test_cpu_node_runs_the_configured_engines_with_free_ports():
    plan = plan_node(config("engine.num_engines=2"), NodeEnv(), num_gpus=0)
    assert plan.runs_trainer and plan.trainer_gpus == ()
    assert [(e.index, e.gpus, e.port) for e in plan.engines] == [(0, (), 0), (1, (), 0)]
    fixed = plan_node(config("engine.num_engines=2", "engine.base_port=9000"), NodeEnv(), num_gpus=0)
    assert [e.port for e in fixed.engines] == [9000, 9001]


def test_gpu_node_zero_gives_the_trainer_the_first_gpus_and_fills_the_rest_with_engines():
    plan = plan_node(config("trainer.num_processes=3", "engine.num_engines=0"), NodeEnv(), num_gpus=8)
    assert plan.trainer_gpus == (0, 1, 2)
    assert [e.gpus for e in plan.engines] == [(3,), (4,), (5,), (6,), (7,)]
    assert "trainer on GPUs 0,1,2" in plan.describe() and "engine4 on GPUs 7" in plan.describe()


def test_other_nodes_run_only_engines_on_every_gpu():
    node = NodeEnv(2, 1, "10.0.0.1")
    plan = plan_node(config("trainer.num_processes=4", "engine.num_engines=0", "engine.host=0.0.0.0"), node, 4)
    assert not plan.runs_trainer and plan.trainer_gpus == ()
    assert [e.gpus for e in plan.engines] == [(0,), (1,), (2,), (3,)]


def test_a_trainer_over_two_nodes_takes_the_first_gpus_of_each_and_engines_the_rest():
    cfg = config("trainer.num_nodes=2", "trainer.num_processes=8", "engine.num_engines=0", "engine.host=0.0.0.0",
                 "engine.kind=vllm", "engine.tensor_parallel_size=2")
    node0, node1, node2 = (plan_node(cfg, NodeEnv(3, r, "10.0.0.1"), 8) for r in range(3))
    for node in (node0, node1):
        assert node.runs_trainer and node.trainer_gpus == (0, 1, 2, 3) and node.trainer_processes == 4
        assert [e.gpus for e in node.engines] == [(4, 5), (6, 7)]
    assert (node0.first_trainer_rank, node1.first_trainer_rank) == (0, 4)
    assert node0.main and not node1.main
    assert not node2.runs_trainer and node2.trainer_gpus == ()
    assert [e.gpus for e in node2.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert "trainer ranks 4-7 on GPUs 0,1,2,3" in node1.describe() and "engine1 on GPUs 6,7" in node1.describe()
    # on CPU each trainer node runs its share of the processes beside its engines
    cpu = plan_node(config("trainer.num_nodes=2", "trainer.num_processes=2", "engine.host=0.0.0.0"),
                    NodeEnv(2, 1, "10.0.0.1"), 0)
    assert cpu.runs_trainer and cpu.trainer_processes == 1 and cpu.first_trainer_rank == 1 and len(cpu.engines) == 1
    assert "trainer rank 1 on CPU" in cpu.describe()


def test_tensor_parallel_engines_take_that_many_gpus_each():
    plan = plan_node(config("trainer.num_processes=2", "engine.kind=vllm", "engine.tensor_parallel_size=2",
                            "engine.num_engines=2"), NodeEnv(), 8)
    assert [e.gpus for e in plan.engines] == [(2, 3), (4, 5)]  # GPUs 6 and 7 left idle, as asked
    assert plan.engines[1].env() == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert plan.engines[0].env(visible="8,9,10,11,12,13,14,15") == {"CUDA_VISIBLE_DEVICES": "10,11"}
    assert "engine1 on GPUs 4,5" in plan.describe()


def test_node_zero_may_leave_the_engines_to_other_nodes():
    plan = plan_node(config("trainer.num_processes=8", "engine.num_engines=0"), NodeEnv(2, 0, "10.0.0.1"), 8)
    assert plan.trainer_gpus == tuple(range(8)) and plan.engines == ()


@pytest.mark.parametrize("overrides, node, gpus, key", [
    (["engine.num_engines=0"], NodeEnv(), 0, "engine.num_engines: 0 fills"),
    (["trainer.num_processes=4"], NodeEnv(), 2, "trainer.num_processes: 4 trainer processes"),
    (["trainer.num_processes=2", "engine.num_engines=3"], NodeEnv(), 4, "engine.num_engines: 3 engines"),
    (["trainer.num_processes=2", "engine.num_engines=0"], NodeEnv(), 2, "engine.num_engines: no GPU is left"),
    ([], NodeEnv(2, 1, "10.0.0.1"), 0, "engine.host: 127.0.0.1 is reachable only from this node"),
    (["trainer.num_nodes=2", "trainer.num_processes=2"], NodeEnv(), 4, "trainer.num_nodes: the trainer spans 2 nodes"),
    (["trainer.num_nodes=2", "trainer.num_processes=10", "engine.host=0.0.0.0"], NodeEnv(2, 1, "h"), 4,
     "trainer.num_processes: 5 trainer processes need as many GPUs on each of the trainer.num_nodes 2"),
    (["trainer.num_processes=3", "engine.kind=vllm", "engine.tensor_parallel_size=2", "engine.num_engines=0"],
     NodeEnv(), 8, "engine.tensor_parallel_size: engines of 2 GPUs do not divide the 5 GPUs left on node 0"),
    (["trainer.num_processes=2", "engine.kind=vllm", "engine.tensor_parallel_size=4", "engine.num_engines=2"],
     NodeEnv(), 8, r"engine.num_engines: 2 engines need 4 GPUs each \(engine.tensor_parallel_size\)"),
    (["engine.kind=vllm", "engine.tensor_parallel_size=2", "engine.colocate_with_trainer=true"], NodeEnv(), 2,
     "engine.tensor_parallel_size: 2 GPUs per engine, but colocated engines"),
])
def test_placements_that_do_not_fit_name_the_key(overrides, node, gpus, key):
    with pytest.raises(ConfigError, match=key):
        plan_node(config(*overrides), node, gpus)


def test_gpu_env_maps_indices_through_the_launchers_own_visible_devices():
    assert gpu_env(()) == {}
    assert gpu_env((0, 1)) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu_env((0, 2), visible="4,5,6") == {"CUDA_VISIBLE_DEVICES": "4,6"}


def test_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("node7")
    assert advertised_host("10.1.2.3", "10.0.0.1", 29500) == "10.1.2.3"
    assert advertised_host("0.0.0.0", "127.0.0.1", 29500) == "127.0.0.1"


def test_config_keys_are_validated():
    with pytest.raises(ConfigError, match="trainer.num_processes"):
        config("trainer.num_processes=0")
    with pytest.raises(ConfigError, match="trainer.accelerate_config"):
        config("trainer.accelerate_config=/no/such.yaml")
    with pytest.raises(ConfigError, match="engine.base_port"):
        config("engine.base_port=70000")
    with pytest.raises(ConfigError, match="trainer.num_processes: 3 processes do not divide evenly over "
                                          "trainer.num_nodes 2"):
        config("trainer.num_nodes=2", "trainer.num_processes=3")
    config("trainer.accelerate_config=configs/accelerate/deepspeed_zero3.yaml")


# --- the rendezvous, over a real TCPStore on loopback ---------------------------------------------------------


def nodes(world: int, timeout_s: float = 20.0) -> list[NodeRendezvous]:
    port = free_port()
    return [NodeRendezvous(NodeEnv(world, r, "127.0.0.1", port), timeout_s, key="the run's key") for r in range(world)]


def test_a_value_not_signed_with_the_runs_key_is_never_acted_on():
    """Anyone who reaches MASTER_ADDR:MASTER_PORT can write into node 0's store: a value set there without the run's
    key (or with another key) stops the node that reads it, naming the store, instead of being believed."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from pipelinerl.nodes import RendezvousForged

    node0, node1 = nodes(2)
    port = node0.node.master_port
    intruder = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10), wait_for_workers=False)
    intruder.set("model_ready", json.dumps({"path": "/attacker/model", "name": "", "start_timeout_s": 1}))
    with pytest.raises(RendezvousForged, match=r"'model_ready' in node 0's store at 127.0.0.1:\d+ is not signed"):
        node1.wait_model()
    other = NodeRendezvous(NodeEnv(2, 1, "127.0.0.1", port), 10, key="another key")
    node0.model_ready("/shared/model")
    with pytest.raises(RendezvousForged, match="different keys"):
        other.wait_model()
    assert node1.wait_model().path == "/shared/model"  # signed with the run's key: taken
    intruder.set("engines/1", json.dumps(["http://attacker:1"]))
    node1.engines_starting()
    with pytest.raises(RendezvousForged, match="'engines/1'"):
        node0.gather_engines([], check=lambda: None)


def test_rendezvous_hands_the_model_and_the_engine_urls_to_node_zero():
    node0, node1, node2 = nodes(3)
    node0.model_ready("/shared/model", "Org/Model", 1234.0)
    assert node1.wait_model() == ModelReady("/shared/model", "Org/Model", 1234.0)
    node2.engines_starting()
    node2.publish_engines(["http://c:1"])
    node1.engines_starting()
    threading.Timer(0.3, node1.publish_engines, [["http://b:1", "http://b:2"]]).start()
    urls = node0.gather_engines(["http://a:1"], check=lambda: None)
    assert urls == ["http://a:1", "http://b:1", "http://b:2", "http://c:1"]  # node order, whenever they arrive


def test_a_node_still_preparing_is_waited_for_past_the_join_deadline_and_its_engines_are_not():
    """Fetching a 65 GB model on a node can outlast any fixed deadline: while the node beats, node 0 waits for it
    to start its engines; from then on, the engines' start deadline (plus a margin) applies."""
    import pipelinerl.nodes as nodes_module

    node0, node1 = nodes(2, timeout_s=0.5)
    node1.start_heartbeat(interval_s=0.05)
    threading.Timer(1.5, node1.engines_starting).start()  # three times the join deadline after joining
    started = time.monotonic()
    margin = nodes_module.ENGINES_MARGIN_S
    nodes_module.ENGINES_MARGIN_S = 0.0
    try:
        with pytest.raises(TimeoutError, match="no engines from node 1 after 1s"):
            node0.gather_engines([], check=lambda: None, start_timeout_s=1.0)
    finally:
        nodes_module.ENGINES_MARGIN_S = margin
        node1.stop_heartbeat()
    assert 2.2 < time.monotonic() - started < 6  # 1.5 s until its engines started, then their 1 s deadline


def test_a_failing_node_stops_node_zero_with_its_message():
    node0, node1 = nodes(2)
    node1.fail("engine0 exited with code -9")
    with pytest.raises(RuntimeError, match="node 1 failed: engine0 exited with code -9"):
        node0.gather_engines([], check=lambda: None)


def test_finish_reaches_the_other_nodes_before_node_zero_goes():
    node0, node1 = nodes(2)
    assert node1.finished() is None
    statuses = []
    reader = threading.Thread(target=lambda: (time.sleep(0.3), statuses.append(node1.finished())))
    reader.start()
    started = time.monotonic()
    node0.finish(ok=True, wait_s=10)
    reader.join()
    assert statuses == ["ok"] and time.monotonic() - started < 5  # node 0 waited for the acknowledgement


def test_a_node_zero_that_is_gone_is_noticed():
    node0, node1 = nodes(2)
    del node0  # the store's server goes with it
    with pytest.raises(NodeLost, match="node 0"):
        for _ in range(50):
            node1.finished()
            time.sleep(0.1)


def test_the_trainer_start_reaches_the_trainer_nodes():
    node0, node1 = nodes(2)
    threading.Timer(0.3, node0.start_trainer, [4321, ["http://a:1", "http://b:1"]]).start()
    assert node1.wait_trainer(check=lambda: None) == (4321, ["http://a:1", "http://b:1"])


def test_a_node_whose_heartbeat_stops_is_named_by_node_zero_and_not_waited_for():
    node0, node1, node2 = nodes(3)
    node1.start_heartbeat(interval_s=0.05)
    node2.start_heartbeat(interval_s=0.05)
    for _ in range(5):  # both beat: nothing to say
        node0.check_nodes(lost_after_s=0.5)
        time.sleep(0.1)
    node2.stop_heartbeat()  # as if node 2's machine went away
    started = time.monotonic()
    with pytest.raises(NodeLost, match="node 2 is gone"):
        while time.monotonic() - started < 5:
            node0.check_nodes(lost_after_s=0.5)
            time.sleep(0.05)
    # the end of the run waits for node 1's acknowledgement only
    threading.Timer(0.2, node1.finished).start()
    started = time.monotonic()
    node0.finish(ok=False, wait_s=10)
    assert time.monotonic() - started < 5


def test_the_root_cause_of_a_failure_is_the_other_node_that_reported_or_went_silent():
    local = RuntimeError("trainer exited with code 1")
    for silent in (False, True):
        node0, node1, node2 = nodes(3)
        node1.start_heartbeat(interval_s=0.05)
        node2.start_heartbeat(interval_s=0.05)
        # all alive, nobody reported: the local failure
        assert node0.root_cause(local, grace_s=0.5, silent_s=0.3) is local
        if silent:
            node2.stop_heartbeat()
            expected = "node 2 is gone"
        else:  # reported a moment after node 0's trainer noticed the lost peer
            threading.Timer(0.2, node1.fail, ["trainer exited with code -9"]).start()
            expected = "node 1 failed: trainer exited with code -9"
        cause = str(node0.root_cause(local, grace_s=1.0, silent_s=0.3))
        node1.stop_heartbeat()  # before node 0's store goes
        assert expected in cause and "(then on node 0: trainer exited with code 1)" in cause


def test_waiting_for_an_absent_node_times_out_naming_it():
    node0, _ = nodes(2, timeout_s=1.0)
    with pytest.raises(TimeoutError, match="node 1 never joined the run"):
        node0.gather_engines([], check=lambda: None)


def test_trainer_command_per_setting():
    from pipelinerl.launch import trainer_command

    def cmd(gpus: int, *overrides: str) -> list[str]:
        return trainer_command(config(*overrides), "run/config.yaml", "http://a:1", gpus)

    role = ["-m", "pipelinerl.train", "run/config.yaml", "--engines", "http://a:1"]
    assert cmd(0)[1:] == role and cmd(1)[1:] == role  # one process: the role itself
    cpu = cmd(0, "trainer.num_processes=2")
    assert cpu[3:6] == ["torch.distributed.run", "--standalone", "--nproc-per-node"] and cpu[-5:] == role
    gpu = cmd(4, "trainer.num_processes=4")
    assert "accelerate.commands.launch" in gpu and "--multi_gpu" in gpu and gpu[-5:] == role
    zero3 = cmd(4, "trainer.num_processes=4", "trainer.accelerate_config=configs/accelerate/deepspeed_zero3.yaml")
    assert zero3[zero3.index("--config_file") + 1] == "configs/accelerate/deepspeed_zero3.yaml"
    assert "--multi_gpu" not in zero3 and zero3[zero3.index("--num_processes") + 1] == "4"


def test_trainer_command_for_a_share_of_a_trainer_over_several_nodes():
    from pipelinerl.launch import trainer_command

    def cmd(gpus: int, *overrides: str) -> list[str]:
        return trainer_command(config("trainer.num_nodes=2", *overrides), "c.yaml", "http://a:1", gpus, 1, "10.0.0.1",
                               4321)

    def value(command: list[str], flag: str) -> str:
        return command[command.index(flag) + 1]

    cpu = cmd(0, "trainer.num_processes=2")
    assert "--standalone" not in cpu and "torch.distributed.run" in cpu
    assert [value(cpu, f) for f in ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--nproc-per-node")] \
        == ["2", "1", "10.0.0.1", "4321", "1"]
    gpu = cmd(4, "trainer.num_processes=8")  # accelerate counts the processes of all machines
    assert [value(gpu, f) for f in ("--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                                    "--main_process_port")] == ["8", "2", "1", "10.0.0.1", "4321"]
    assert "--multi_gpu" in gpu and "--deepspeed_multinode_launcher" not in gpu
    zero3 = cmd(4, "trainer.num_processes=8", "trainer.accelerate_config=configs/accelerate/deepspeed_zero3.yaml")
    assert value(zero3, "--deepspeed_multinode_launcher") == "standard"  # not pdsh: each node starts its own share


def test_roles_wait_for_the_engine_urls_the_launcher_writes_once_the_engines_answer(tmp_path):
    import threading
    import time

    from pipelinerl.procs import engine_urls, write_engine_urls

    assert engine_urls("http://a:1,http://b:2") == ["http://a:1", "http://b:2"]
    path = tmp_path / "engine_urls"
    threading.Timer(0.3, write_engine_urls, (path, ["http://127.0.0.1:5", "http://127.0.0.1:6"])).start()
    start = time.monotonic()
    assert engine_urls(f"@{path}") == ["http://127.0.0.1:5", "http://127.0.0.1:6"]
    assert time.monotonic() - start >= 0.25
    assert [p.name for p in tmp_path.iterdir()] == ["engine_urls"]  # written whole, nothing left beside it
    # a stop while waiting returns None; no file in time names the file
    assert engine_urls(f"@{tmp_path / 'never'}", should_stop=lambda: True) is None
    with pytest.raises(TimeoutError, match="never"):
        engine_urls(f"@{tmp_path / 'never'}", timeout_s=0.2)



def test_gpus_are_counted_by_torch_where_a_gpu_driver_is(monkeypatch):
    """Without a GPU driver's device file the count is 0 without torch (tests/test_serve.py); with one, torch is
    asked (here it sees no GPU)."""
    import torch

    from pipelinerl import placement

    monkeypatch.setattr(placement.os.path, "exists", lambda path: True)
    assert placement.detect_gpus() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
