"""`pipelinerl serve --decode-cpus`: the embedded engine decodes on its own CPUs and receives weights on the
others (pipelinerl/engines/embedded/cpus.py)."""

import os
from pathlib import Path

import pytest
from conftest import run_cli, running_engine
from test_engine import PROMPT, Trainer, receiver_pid

from pipelinerl.engines.embedded.cpus import CpuListError, CpuSplit, parse_cpu_list

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.parametrize("text,cpus", [("0", {0}), ("0,2", {0, 2}), ("1-3,6", {1, 2, 3, 6}), (" 4 , 5 ", {4, 5})])
def test_cpu_lists_parse(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0-x", ","])
def test_bad_cpu_lists_name_the_option(text):
    with pytest.raises(CpuListError, match="--decode-cpus"):
        parse_cpu_list(text)


@pytest.mark.skipif(not ALLOWED, reason="Linux only")
def test_cpus_outside_the_process_affinity_are_refused():
    with pytest.raises(CpuListError, match=r"--decode-cpus: CPU\(s\) \[100000\] are not available"):
        CpuSplit(frozenset({100000}))
    split = CpuSplit(frozenset(ALLOWED))  # every CPU: transfers share them rather than having none
    assert split.decode == split.transfer == frozenset(ALLOWED)


def _threads(pid: int) -> dict[int, tuple[frozenset[int], int]]:
    """{thread id: (CPUs it may run on, CPU ticks used)} from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        cpus = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                    if line.startswith("Cpus_allowed_list"))
        out[int(tid)] = (parse_cpu_list(cpus), int(stat[11]) + int(stat[12]))  # utime + stime
    return out


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs to split")
@pytest.mark.parametrize("receiver", ["process", "thread"])
def test_engine_decodes_on_its_cpus_and_receives_on_the_others(tiny_model_dir, tmp_path, receiver):
    """The decoding thread runs on --decode-cpus; what receives (the receiving process, or the receiving and gloo
    threads) on the others. With a receiving process the server's HTTP thread runs on the decoding CPUs too."""
    decode, rest = frozenset(ALLOWED[:1]), frozenset(ALLOWED[1:])
    extra = ["--decode-cpus", str(ALLOWED[0]), "--update-receiver", receiver]
    with running_engine(tiny_model_dir, tmp_path, extra=extra) as client:
        trainer = Trainer(client, tiny_model_dir)
        try:
            before = _threads(client.process.pid)
            receiving = receiver_pid(client.process.pid) if receiver == "process" else client.process.pid
            for _ in range(3):  # decoding and updates, both
                client.generate(PROMPT, temperature=0, max_new_tokens=200, ignore_eos=True)
                assert trainer.push(trainer.perturbed(seed=trainer.version), bucket_bytes=4096).version \
                    == trainer.version
            after, receiving_after = _threads(client.process.pid), _threads(receiving)
        finally:
            trainer.group.destroy()
    # the thread that decoded (it used the most CPU during the generations) is pinned to the decoding CPUs
    used = {tid: ticks - before.get(tid, (None, 0))[1] for tid, (_, ticks) in after.items()}
    decoder = max(used, key=used.get)
    assert after[decoder][0] == decode, after
    if receiver == "thread":  # every other thread of the server on the rest
        assert all(cpus == rest for tid, (cpus, _) in after.items() if tid != decoder), after
    else:  # every thread of the receiving process (gloo's among them) on the rest
        assert all(cpus == rest for cpus, _ in receiving_after.values()), receiving_after


def test_serve_refuses_a_bad_cpu_list_before_loading(tiny_model_dir):
    proc = run_cli(["serve", "--model", str(tiny_model_dir), "--port", "0", "--decode-cpus", "5-2"])
    assert proc.returncode != 0
    assert "--decode-cpus '5-2'" in proc.stderr and "Traceback" not in proc.stderr
